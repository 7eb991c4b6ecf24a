"""A wide-and-deep click model on Criteo-format logs, its embedding tables on the parameter servers.

    paratrain launch -w 2 -s 2 examples/ctr.py [--train day_0.tsv --test day_1.tsv] [--epochs 2]
    paratrain launch -w 2 -s 2 examples/ctr.py --serve      # ... and answer clicks while it trains
    python examples/ctr.py                   # alone: one process, tables in this process

Without --train, every worker writes the same synthetic logs (power-law ids, see
paratrain.data.criteo) to a temporary folder and reads them back with the Criteo reader. Each worker
trains on its own shard of the lines (the Trainer's sampler). The 26 categorical features share two
sparse tables on the servers, sharded by id, with Adagrad running there: "deep" (16 values a row, one
lookup per feature) and "wide" (1 value a row, summed per line). The dense part (an MLP over the 13
integer features and the looked-up rows) is synced by all-reduce (strategy "hybrid"; "ps" sends it
through the servers too, "local" not at all). Worker 0 prints the held-out AUC at the end.

Serving while it trains (--serve): the Trainer checkpoints the dense part every --checkpoint-every
steps; after the first checkpoint worker 0 starts

    paratrain serve --join --model examples/ctr.py:serving_model --input dense:float32:13 \
                    --input ids:int64:26 CHECKPOINT_DIR

as a process of its own (any process with the job's PARATRAIN_SCHEDULER and PARATRAIN_SECRET can).
It reads the tables from the same servers as a read-only client, reloads the dense part from each
newer checkpoint, and worker 0 asks it for click probabilities of a few held-out lines (and for some
of their "deep" rows) as training goes on, printing what it answered.
"""

import argparse
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
import paratrain.kvstore
from paratrain.data.criteo import NUM_CATEGORICAL, NUM_DENSE, read_criteo, write_synthetic_criteo
from paratrain.errors import MissingExtraError
from paratrain.kvstore import DistributedEmbedding, TableConfig

try:
    from sklearn.metrics import roc_auc_score
except ImportError as exc:  # the examples' extra
    raise MissingExtraError("scikit-learn", "examples", "examples/ctr.py") from exc

UNSEEN_ID = 2**62 + 7  # an id no synthetic line has: its row is never created


# --8<-- [start:model]
class WideAndDeep(nn.Module):
    def __init__(self, kv: object, dim: int) -> None:
        super().__init__()
        tables = TableConfig(initializer="normal", init_scale=0.05, admit_after=1)
        adagrad = {"optimizer": torch.optim.Adagrad, "optimizer_args": {"lr": 0.05}, "kv": kv}
        self.deep = DistributedEmbedding("deep", dim, config=tables, **adagrad)
        self.wide = DistributedEmbedding("wide", 1, mode="sum", config=TableConfig("zeros"), **adagrad)
        self.dense = nn.Sequential(nn.Linear(NUM_DENSE, dim), nn.ReLU())
        width = (NUM_CATEGORICAL + 1) * dim
        self.top = nn.Sequential(nn.Linear(width, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        deep = torch.cat([self.deep(ids).flatten(1), self.dense(dense)], dim=1)
        return (self.top(deep) + self.wide(ids)).squeeze(1)


# --8<-- [end:model]


def serving_model(kv: object, dim: int = 16) -> WideAndDeep:
    """What `paratrain serve --join` builds: the same tables, read from the running job's servers."""
    return WideAndDeep(kv, dim)


class ServingProbe:
    """`paratrain serve --join` on this job, started by worker 0, and the questions it is asked."""

    def __init__(self, checkpoint_dir: str, dense: torch.Tensor, ids: torch.Tensor) -> None:
        with socket.socket() as sock:  # a port free a moment ago
            sock.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.dense, self.ids = dense, ids
        argv = [sys.executable, "-c", "from paratrain.launch.cli import main; main()", "serve", "--join"]
        argv += [
            "--model",
            f"{os.path.abspath(__file__)}:serving_model",
            "--port",
            self.url.rsplit(":", 1)[1],
        ]
        argv += ["--input", f"dense:float32:{NUM_DENSE}", "--input", f"ids:int64:{NUM_CATEGORICAL}"]
        argv += ["--reload-interval", "0.5", "--cache-ttl", "0.2", "--threads", "1", checkpoint_dir]
        self.process = subprocess.Popen(argv)  # inherits PARATRAIN_SCHEDULER and PARATRAIN_SECRET

    def _post(self, path: str, doc: dict) -> dict:
        request = urllib.request.Request(
            self.url + path, json.dumps(doc).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())

    def wait_until_up(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                urllib.request.urlopen(self.url + "/healthz", timeout=5).close()
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        raise RuntimeError(
            f"the serving process did not answer at {self.url} (exit code {self.process.poll()})"
        )

    def ask(self, step: int, newer_than: int = -1, timeout_s: float = 60.0) -> int:
        """Asks, and prints the answer; with `newer_than`, first waits (at most timeout_s) until the
        served dense part comes from a checkpoint after that step. Returns the served model step."""
        inputs = {"inputs": {"dense": self.dense.tolist(), "ids": self.ids.tolist()}}
        clicks = self._post("/predict", inputs)
        deadline = time.monotonic() + timeout_s
        while clicks["model_step"] <= newer_than and time.monotonic() < deadline:
            time.sleep(0.2)  # the server reloads a newer checkpoint within its reload interval
            clicks = self._post("/predict", inputs)
        probabilities = torch.sigmoid(torch.tensor(clicks["outputs"]))
        asked = [*self.ids[0, :3].tolist(), UNSEEN_ID]
        rows = torch.tensor(self._post("/embeddings", {"table": "deep", "ids": asked})["rows"])
        print(
            f"served at step {step}: model_step {clicks['model_step']} clicks "
            f"{[round(p, 4) for p in probabilities.tolist()]} deep rows {rows[:3, :2].flatten().tolist()} "
            f"unseen row zero {bool((rows[3] == 0).all())}",
            flush=True,
        )
        return int(clicks["model_step"])

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", help="Criteo-format TSV to train on (default: synthetic)")
    parser.add_argument("--test", help="held-out TSV (default: synthetic)")
    parser.add_argument("--rows", type=int, default=40_000, help="synthetic training lines")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--kind", default="dist_sync", help="kvstore kind for the tables")
    parser.add_argument(
        "--strategy", default="hybrid", help="hybrid: dense part by all-reduce; ps: on servers too"
    )
    parser.add_argument("--checkpoint-dir", help="checkpoint the dense part here (--serve: a temporary one)")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--serve", action="store_true", help="worker 0 serves clicks while the job trains")
    parser.add_argument("--ask-every", type=int, default=10, help="--serve: steps between questions")
    args = parser.parse_args()

    ctx = paratrain.init()  # the scheduler and the servers serve inside this call, then exit
    if args.serve and not ctx.num_servers:
        parser.error("--serve reads the tables from the job's servers: paratrain launch -w 2 -s 2 ...")
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="ctr-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the generated data, checkpoints
    if args.train is None:
        args.train, args.test = os.path.join(folder, "train.tsv"), os.path.join(folder, "test.tsv")
        write_synthetic_criteo(args.train, args.rows, seed=1)
        write_synthetic_criteo(args.test, args.rows // 4, seed=2)
    if args.serve and args.checkpoint_dir is None:
        args.checkpoint_dir = os.path.join(folder, "ckpt")  # the same path on every worker (one host)
        args.checkpoint_dir = ctx.barrier(name="ctr-checkpoint-dir", data=args.checkpoint_dir)[0]
    labels, dense, ids = read_criteo(args.train).tensors  # the Trainer gives each worker its shard
    test_labels, test_dense, test_ids = read_criteo(args.test).tensors

    # --8<-- [start:train]
    torch.manual_seed(0)  # every worker starts from the same dense weights
    kv = paratrain.kvstore.create(args.kind)
    model = WideAndDeep(kv, args.dim)
    optimizer = torch.optim.Adam(
        model.parameters(), lr=2e-3
    )  # the dense part; the tables step on the servers
    trainer = paratrain.Trainer(  # hybrid: dense by all-reduce, tables on the servers
        model,
        optimizer,
        DataLoader(TensorDataset(dense, ids, labels), batch_size=args.batch, shuffle=True),
        strategy=args.strategy,
        progress=False,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every if args.checkpoint_dir else 0,
    )
    # --8<-- [end:train]
    probe = None
    start = time.perf_counter()
    for epoch in trainer.epochs(args.epochs):
        for step, (dense_batch, id_batch, label_batch) in enumerate(trainer.loader):
            logits = trainer.model(dense_batch, id_batch)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, label_batch)
            trainer.step(loss)  # the tables' row gradients are pushed during backward
            if ctx.rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step:4d}  loss {loss.item():.4f}", flush=True)
            if ctx.rank == 0 and args.serve and trainer.steps >= args.checkpoint_every:
                if probe is None:  # the first checkpoint is there: start serving, wait for it once
                    probe = ServingProbe(args.checkpoint_dir, test_dense[:4], test_ids[:4])
                    probe.wait_until_up()
                    first_served = probe.ask(trainer.steps)
                elif trainer.steps % args.ask_every == 0:
                    probe.ask(trainer.steps)
    if probe is not None:  # the last answer comes from a newer checkpoint than the first did
        probe.ask(trainer.steps, newer_than=first_served)
        probe.close()
    trainer.close()

    model.eval()
    with torch.no_grad():  # held-out ids the tables never saw read as zeros
        scores = torch.cat(
            [model(test_dense[i : i + 4096], test_ids[i : i + 4096]) for i in range(0, len(test_ids), 4096)]
        )
    auc = roc_auc_score(test_labels.numpy(), scores.numpy())
    rows = sum(s["rows"] for s in kv.table_stats("deep"))
    if ctx.rank == 0:
        print(
            f"held-out AUC {auc:.4f} ({len(test_labels)} lines; {rows} rows in table 'deep'; "
            f"{time.perf_counter() - start:.1f} s training, strategy {trainer.strategy.architecture})"
        )


if __name__ == "__main__":
    main()
