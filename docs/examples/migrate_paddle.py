"""After: a Paddle Fleet parameter-server job on paratrain (docs/migrating/paddle.md).

    paratrain launch -w 2 -s 1 docs/examples/migrate_paddle.py  # was: fleetrun --server_num 1 --worker_num 2

A sparse embedding table on the servers (Fleet's sparse_embedding), updated asynchronously (Fleet's
a_sync), and a dense part trained on the servers too.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.kvstore import DistributedEmbedding

ctx = paratrain.init()  # was: fleet.init(); if fleet.is_server(): fleet.init_server(); fleet.run_server()
torch.manual_seed(0)
ids = torch.randint(0, 10**9, (4096, 4))  # 4 sparse features a line: ids from a huge space
ids[:, 0] = torch.randint(0, 50, (4096,))  # the first feature alone decides the click
clicks = (ids[:, 0] % 2 == 0).float()
loader = DataLoader(TensorDataset(ids, clicks), batch_size=64, shuffle=True)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # was: paddle.static.nn.sparse_embedding(input=ids, size=[1024, 8], ...)
        self.embedding = DistributedEmbedding("ids", 8, mode="sum", optimizer=torch.optim.Adagrad)
        self.top = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.top(self.embedding(ids)).squeeze(1)


model = Model()
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)  # the dense part's optimizer
# was: strategy = fleet.DistributedStrategy(); strategy.a_sync = True;
#      optimizer = fleet.distributed_optimizer(optimizer, strategy)
trainer = paratrain.Trainer(model, optimizer, loader, strategy="ps:consistency=async", progress=False)
for epoch in trainer.epochs(3):
    for id_batch, click_batch in trainer.loader:
        trainer.step(nn.functional.binary_cross_entropy_with_logits(trainer.model(id_batch), click_batch))
with torch.no_grad():
    accuracy = ((trainer.model(ids) > 0).float() == clicks).float().mean().item()
trainer.close()  # was: fleet.stop_worker()
print(f"worker {ctx.rank}: accuracy {accuracy:.3f}")
