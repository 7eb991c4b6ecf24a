"""A small job that shows every role at work: workers find the servers through the scheduler, send
tensors to every server and check what comes back, and meet at barriers.

    paratrain launch -w 2 -s 1 examples/demo.py
"""

import torch

import paratrain
from paratrain.transport.rpc import RpcClient

ctx = paratrain.init()  # the scheduler and the servers serve inside this call, then exit
print(f"worker {ctx.rank} of {ctx.num_workers}; servers at {ctx.servers}")
for server_rank, (host, port) in enumerate(ctx.servers):
    client = RpcClient(host, port, ctx.spec.secret, name=f"server {server_rank}")
    sent = torch.randn(1 << 20)
    reply = client.call("ping", {"from": ctx.rank}, [sent])
    assert torch.equal(reply.tensors[0], sent) and reply.meta == {"from": ctx.rank}
    print(f"worker {ctx.rank}: server {server_rank} echoed 4 MiB intact")
    client.close()
ctx.barrier()
print(f"worker {ctx.rank}: done")
