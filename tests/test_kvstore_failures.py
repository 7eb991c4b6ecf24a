"""What the kvstore does with bad calls and stuck workers (issue 13): a refused call changes nothing,
every message names what was wrong, and no wait is silent or blames the wrong worker."""

from __future__ import annotations

import pytest
import torch

from paratrain.errors import TransportError
from paratrain.kvstore import KVStoreConfig, api, create
from paratrain.kvstore.worker.client import DistKVStore
from paratrain.testing import run_job

# Every bad call is made once, on one worker, between good rounds: a refused call must leave no
# trace (no clock moved, no connection closed), or the next round hangs until request_timeout_s
# (20 s here, so that a broken store fails the job instead of hanging the test).
BAD_CALLS_JOB = """
import torch, paratrain, paratrain.kvstore
from paratrain.cluster.config import JobConfig
from paratrain.kvstore import KVStoreConfig
from paratrain.transport.config import TransportConfig
ctx = paratrain.init(JobConfig(transport=TransportConfig(request_timeout_s=20)))
kv = paratrain.kvstore.create(KVStoreConfig(refuse_non_finite=True))
def attempt(name, fn):
    try:
        fn()
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
    else:
        print(f"{name}: no error", flush=True)
kv.init("w", torch.zeros(4))
kv.init_table("t", 4)
out = torch.empty(4)
def round_(r):
    kv.pushpull("w", torch.full((4,), float(ctx.rank + 1)), out=out)
    print(f"round {r}", out.tolist(), flush=True)
if ctx.rank == 0:
    attempt("bad out", lambda: kv.pushpull("w", torch.ones(4), out=torch.empty(3)))
    attempt("bad out list", lambda: kv.pushpull(["w"], [torch.ones(4)], out=[torch.empty(4, 1)]))
    attempt("bad value", lambda: kv.push("w", torch.ones(5)))
    attempt("long key", lambda: kv.push("k" * 100_000, torch.ones(1)))
    attempt("huge int key", lambda: kv.init(2**70, torch.zeros(1)))
    rows = torch.empty(2, 4)
    attempt("float ids", lambda: kv.row_sparse_pull("t", out=rows, row_ids=torch.tensor([1.0, 2.0])))
    attempt("sparse grads", lambda: kv.push_sparse("t", torch.tensor([1, 2]), torch.ones(2, 3)))
    attempt("sparse nan", lambda: kv.push_sparse("t", torch.tensor([1, 2]), torch.full((2, 4), float("nan"))))
else:
    attempt("nan push", lambda: kv.pushpull("w", torch.tensor([0.0, float("nan"), 1.0, 2.0]), out=out))
    attempt("inf push", lambda: kv.push("w", torch.tensor([0.0, float("inf"), 1.0, 2.0])))
round_(0)
attempt("other shape", lambda: kv.init("v", torch.zeros(2 + ctx.rank)))
round_(1)
print("done", flush=True)
"""


@pytest.fixture(scope="module")
def bad_calls():
    outcome = run_job(BAD_CALLS_JOB, workers=2, servers=1, timeout_s=100, expect=None)
    return outcome


def _line(outcome, rank: int, name: str) -> str:
    lines = [line for line in outcome.lines("worker", rank, "stdout") if line.startswith(name + ":")]
    assert lines, f"worker {rank} printed no {name!r} line:\n{outcome.stderr[-3000:]}"
    return lines[0]


@pytest.mark.timeout(180)
def test_a_refused_call_leaves_no_trace_and_the_rounds_go_on(bad_calls):
    assert bad_calls.exit_code == 0, bad_calls.stderr[-3000:]
    assert "ValueError: out for key 'w' is torch.float32[3]; it must be torch.float32[4]" in _line(
        bad_calls, 0, "bad out"
    )
    assert "is torch.float32[4, 1]; it must be torch.float32[4]" in _line(bad_calls, 0, "bad out list")
    assert "push for key 'w' is torch.float32[5]" in _line(bad_calls, 0, "bad value")
    for rank in (0, 1):  # both workers met in rounds 0 and 1: the refused calls moved no clock
        lines = bad_calls.lines("worker", rank, "stdout")
        assert "round 0 [3.0, 3.0, 3.0, 3.0]" in lines
        assert "round 1 [3.0, 3.0, 3.0, 3.0]" in lines
        assert lines[-1] == "done"


@pytest.mark.timeout(180)
def test_non_finite_pushes_are_refused_naming_the_key_and_the_worker(bad_calls):
    for name in ("nan push", "inf push"):
        line = _line(bad_calls, 1, name)
        assert "ValueError: worker 1 pushed 1 non-finite value(s) (NaN or inf) to key 'w'" in line
    assert "worker 0 pushed 8 non-finite value(s) (NaN or inf) to table 't'" in _line(
        bad_calls, 0, "sparse nan"
    )


@pytest.mark.timeout(180)
def test_bad_keys_are_refused_with_their_limit_and_the_connection_is_kept(bad_calls):
    assert "is 100000 bytes long; the limit is 1024 bytes" in _line(bad_calls, 0, "long key")
    assert "ValueError: key 1180591620717411303424 is outside the int64 range" in _line(
        bad_calls, 0, "huge int key"
    )
    # ...and the next rounds ran over the same connections (checked in the first test)


@pytest.mark.timeout(180)
def test_an_init_with_another_shape_names_both_shapes(bad_calls):
    line = _line(bad_calls, 1, "other shape")
    assert "key 'v' was initialized by worker 0 as float32[2]; this worker's init as float32[3]" in line
    assert _line(bad_calls, 0, "other shape") == "other shape: no error"


@pytest.mark.timeout(180)
def test_bad_sparse_arguments_name_the_dtype_and_the_shape(bad_calls):
    assert "TypeError: row ids must be an int64 or int32 tensor, not torch.float32" in _line(
        bad_calls, 0, "float ids"
    )
    line = _line(bad_calls, 0, "sparse grads")
    assert "ValueError: push to table 't': grads are torch.float32[2, 3]; 2 ids need [2, 4]" in line


def test_keys_the_wire_cannot_carry_are_refused_before_anything_is_sent():
    api.check_key("w" * api.MAX_KEY_BYTES)
    api.check_key(-(2**63))
    for key, error in [
        ("é" * 1000, "2000 bytes long"),
        (2**63, "outside the int64 range"),
        ("\ud800", "not valid Unicode"),
    ]:
        with pytest.raises(ValueError, match=error):
            api.check_key(key)
    with pytest.raises(TypeError, match="is not an int or a str"):
        api.check_key(1.5)


def test_the_local_store_checks_every_argument_before_changing_anything():
    kv = create(KVStoreConfig(local=True, refuse_non_finite=True))
    kv.init("w", torch.zeros(3))
    out = torch.empty(3)
    for call in (
        lambda: kv.pushpull("w", torch.ones(3), out=torch.empty(2)),
        lambda: kv.push("w", torch.ones(4)),
        lambda: kv.pushpull("w", torch.tensor([1.0, float("inf"), 0.0]), out=out),
        lambda: kv.init(["a", "b"], [torch.zeros(1), "not a tensor"]),
    ):
        with pytest.raises((ValueError, TypeError)):
            call()
    kv.pull("w", out=out)
    assert out.tolist() == [0.0, 0.0, 0.0]  # no refused push changed the value
    with pytest.raises(Exception, match="never initialized"):
        kv.pull("a", out=torch.empty(1))  # nor did the refused init keep its first key


class _GoneServer:
    """An RpcClient whose server died: every request raises, as a real one does."""

    name = "server 0 (127.0.0.1:1)"

    def request(self, *args, **kwargs):
        raise TransportError("connection to server 0 (127.0.0.1:1) is down: connection lost")

    def close(self):
        pass


def test_close_at_exit_after_a_server_died_raises_nothing():
    kv = DistKVStore.__new__(DistKVStore)  # just what close() reads: no job needed
    kv._closed, kv._clients, kv._keys, kv._arenas = False, [_GoneServer()], {}, {}
    kv.rank, kv._timeout_s = 0, 1.0
    kv.close()  # at exit (atexit) a raise here printed "Exception ignored in atexit"
    assert kv._closed


# A worker alive but stuck (its heartbeats go on) holds round 1 back: worker 0's pushpull waits,
# says on whom after wait_warning_s (and the server says the same), and at request_timeout_s fails
# naming worker 1, with a KVStoreError. Its sparse pull waits the same way, beside it in a thread:
# the two waits run out together, so the test waits one request_timeout_s rather than two.
STUCK_JOB = """
import threading, time, torch, paratrain, paratrain.kvstore
from paratrain.cluster.config import JobConfig
from paratrain.errors import KVStoreError
from paratrain.kvstore import KVStoreConfig
from paratrain.transport.config import TransportConfig
ctx = paratrain.init(JobConfig(transport=TransportConfig(request_timeout_s=5)))
kv = paratrain.kvstore.create(KVStoreConfig(wait_warning_s=1))
kv.init("w", torch.zeros(2))
kv.init_table("t", 2)
out, ids = torch.empty(2), torch.tensor([5])
kv.pushpull("w", torch.ones(2), out=out)
kv.push_sparse("t", ids, torch.ones(1, 2)).wait()
if ctx.rank == 1:
    while True:          # stuck in its data loader; its heartbeat thread runs on
        time.sleep(1)
kv.push_sparse("t", ids, torch.ones(1, 2)).wait()
sparse_errors = []
def sparse_pull():
    try:
        kv.row_sparse_pull("t", out=torch.empty(1, 2), row_ids=ids)
    except KVStoreError as exc:
        sparse_errors.append(exc)
sparse = threading.Thread(target=sparse_pull)
sparse.start()
try:
    kv.pushpull("w", torch.ones(2), out=out)
except KVStoreError as exc:
    print("KVStoreError:", exc, flush=True)
    raise
finally:
    sparse.join()
    for exc in sparse_errors:  # printed by this thread: two threads' prints at once interleave
        print("sparse KVStoreError:", exc, flush=True)
"""


@pytest.mark.timeout(120)
def test_a_stuck_worker_is_named_by_the_warnings_and_the_error():
    outcome = run_job(STUCK_JOB, workers=2, servers=1, timeout_s=90, expect="failure")
    error = [line for line in outcome.lines("worker", 0, "stdout") if line.startswith("KVStoreError:")]
    assert error, outcome.stderr[-3000:]
    assert "worker 0's pushpull of key 'w' got no reply within 5 s" in error[0]
    assert "round 1 of key 'w' on server 0" in error[0] and "waits for worker(s) 1," in error[0]
    warned = "\n".join(outcome.lines("worker", 0, "stderr"))
    assert "worker 0's pushpull of key 'w' has waited 1 s" in warned
    assert "waits for worker(s) 1, which have not pushed it" in warned
    served = "\n".join(outcome.lines("server", 0, "stderr"))
    assert (
        "server 0: worker 0 waits for round 1 of key 'w' [0, 2), which worker(s) 1 have not pushed" in served
    )
    sparse = [
        line for line in outcome.lines("worker", 0, "stdout") if line.startswith("sparse KVStoreError:")
    ]
    assert sparse and "worker 0's sparse pull of table 't' got no reply within 5 s" in sparse[0]
    assert "round 1 of table 't' on server 0" in sparse[0] and "waits for worker(s) 1," in sparse[0]
    assert "worker 0's sparse pull of table 't' has waited 1 s" in warned
    assert "server 0: worker 0 waits for round 1 of table 't', which worker(s) 1 have not pushed" in served


HOST_JOB = """
import torch, paratrain, paratrain.kvstore
from paratrain.kvstore import KVStoreConfig
ctx = paratrain.init()
kv = paratrain.kvstore.create(KVStoreConfig(aggregation="host", refuse_non_finite=True))
kv.init("w", torch.zeros(4))
out = torch.empty(4)
def attempt(name, fn):
    try:
        fn()
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
if ctx.rank == 1:   # not the host's leader: its own checks must run before the host's collectives
    attempt("bad out", lambda: kv.pushpull("w", torch.ones(4), out=torch.empty(3)))
    attempt("bad pull", lambda: kv.pull("w", out=torch.empty(2, 2)))
    attempt("nan push", lambda: kv.push("w", torch.full((4,), float("nan"))))
    attempt("missing", lambda: kv.push("v", torch.ones(1)))
kv.pushpull("w", torch.full((4,), float(ctx.rank + 1)), out=out)
print("round 0", out.tolist(), flush=True)
"""


@pytest.mark.timeout(180)
def test_the_host_store_checks_every_argument_before_the_hosts_collectives():
    outcome = run_job(HOST_JOB, workers=2, servers=1, timeout_s=100)
    lines = outcome.lines("worker", 1, "stdout")
    assert "bad out: ValueError: out for key 'w' is torch.float32[3]; it must be torch.float32[4]" in lines
    assert (
        "bad pull: ValueError: out for key 'w' is torch.float32[2, 2]; it must be torch.float32[4]" in lines
    )
    assert any(
        line.startswith("nan push: ValueError: worker 1 pushed 4 non-finite value(s)") for line in lines
    )
    missing = "missing: KVStoreError: key 'v' was never initialized (call kv.init first)"
    assert any(line.startswith(missing) for line in lines)  # then the troubleshooting link
    for rank in (0, 1):
        assert outcome.lines("worker", rank, "stdout")[-1] == "round 0 [3.0, 3.0, 3.0, 3.0]"


def test_a_long_wait_warns_and_then_fails_with_a_kvstore_error_naming_the_cause(caplog):
    from paratrain.errors import KVStoreError
    from paratrain.kvstore.api import Handle
    from paratrain.transport.client import Future

    never = Future("'pull' (id 1) from server 0 (127.0.0.1:1)", None)  # its reply never comes
    asked = []

    def diagnose(pending):
        asked.append(pending)
        return "round 1 of key 'w' on server 0 waits for worker(s) 1, which have not pushed it"

    handle = Handle(
        [never], timeout_s=2.0, what="worker 0's pull of key 'w'", diagnose=diagnose, warn_after_s=0.1
    )
    with (
        caplog.at_level("WARNING", logger="paratrain.kvstore.api"),
        pytest.raises(
            KVStoreError, match=r"pull of key 'w' got no reply within 2 s: round 1 .* worker\(s\) 1"
        ),
    ):
        handle.wait()
    assert any("worker 0's pull of key 'w' has waited" in r.getMessage() for r in caplog.records)
    assert asked and all(pending == [0] for pending in asked)
    # without a diagnosis the error still names the server it waited on
    with pytest.raises(KVStoreError, match=r"no reply from server 0 \(127.0.0.1:1\)"):
        Handle([never], timeout_s=0.1).wait()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"wait_warning_s": 0}, "KVStoreConfig.wait_warning_s=0"),
        ({"refuse_non_finite": 1}, "refuse_non_finite=1"),
    ],
)
def test_the_new_settings_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVStoreConfig(**kwargs)
