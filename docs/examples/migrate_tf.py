"""After: a TensorFlow ParameterServerStrategy job on paratrain (docs/migrating/tensorflow.md).

    paratrain launch -w 2 -s 1 docs/examples/migrate_tf.py     # 2 workers, 1 parameter server
    TF_CONFIG='{"cluster": ...}' python docs/examples/migrate_tf.py   # each process, as TF's were

Variables live on the parameter servers and workers update them asynchronously, as under
ParameterServerStrategy; a chief or worker 0 runs the scheduler.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

ctx = paratrain.init()  # reads TF_CONFIG when it is set; was: tf.distribute.cluster_resolver...
torch.manual_seed(0)
x = torch.randn(2048, 10)
y = (x[:, :5].sum(1) > 0).float()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)  # was: a dataset_fn per worker
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))  # was: keras Dense layers
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
# was: strategy = tf.distribute.ParameterServerStrategy(resolver); the optimizer runs on the servers
trainer = paratrain.Trainer(model, optimizer, loader, strategy="dist_async", progress=False)

for epoch in trainer.epochs(4):  # was: model.fit(dataset, epochs=4, steps_per_epoch=...)
    for xb, yb in trainer.loader:
        logits = trainer.model(xb).squeeze(1)
        trainer.step(nn.functional.binary_cross_entropy_with_logits(logits, yb))
with torch.no_grad():
    accuracy = ((trainer.model(x).squeeze(1) > 0).float() == y).float().mean().item()
print(f"worker {ctx.rank}: accuracy {accuracy:.3f}")
