"""The broadcast weight transport on a CUDA machine: ``python -m bench.nccl [--quick]`` (needs a GPU; last line JSON).

Runs gyre's ``weight_transport: nccl`` path end to end except vLLM's model load: the learner process holds a
``WeightPublisher`` behind a real weight server and a ``WeightGroup`` (``services.learner.weight_group``) fed by the
``BackgroundPublisher`` as in a run; each rollout receiver is its own process whose ``NcclTransport`` follows the
announces, joins the group the learner forms, receives every version's buckets into GPU staging and verifies every
checksum (what the rollout service does before handing the version to vLLM).

Reported:
- ``checksum_parity``: ``device_checksum`` on CUDA equals the CPU value (bf16/fp16/fp32, odd byte counts,
  tensors of several 2**24-word steps) — learner and rollouts may sit on different devices.
- ``checksum_gb_s``: ``device_checksum`` throughput on this GPU (GB/s, one 1 GiB bf16 tensor).
- ``nccl_ratio``: GB/s of a version delivered to every receiver by gyre (checksums on the learner's GPU, manifest
  over gRPC, bucketed broadcast, unpacked to host memory and verified on every receiver) ÷ one raw broadcast of the
  same bytes (one flat buffer, GPU to GPU, nothing checked) in a group of the same processes; rounds alternate,
  median of per-round ratios.
- ``corrupt_refused``: a version whose first bucket has one bit flipped is refused by every receiver, fetched over
  gRPC instead (bit-exact), and the next version travels in the group again; ``bit_exact``: a delivered version
  equals the learner's.

One GPU: NCCL refuses two ranks on one device ("Duplicate GPU detected"), so each process gets its own
``NCCL_HOSTID``; NCCL then treats them as separate hosts and moves bytes through its socket transport over
loopback, not NVLink or P2P. The ratio compares like with like; the absolute GB/s are not a cluster's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_DRY_RUN = os.environ.get("GYRE_BENCH_NCCL_CPU") == "1"
"""Debug only: gloo on CPU instead of NCCL on CUDA, to check the harness on a machine without a GPU."""
DEVICE = "cpu" if CPU_DRY_RUN else "cuda"
SMOLLM2 = {"vocab": 49152, "hidden": 576, "inter": 1536, "layers": 30, "kv": 192}
QWEN_1_5B = {"vocab": 151936, "hidden": 1536, "inter": 8960, "layers": 28, "kv": 256}
TINY = {"vocab": 1024, "hidden": 64, "inter": 128, "layers": 2, "kv": 32}
"""A ~0.3 MB version for checking the harness itself (the CPU dry run in tests/unit/bench/test_bench_nccl.py)."""
MODELS = {"smollm2": SMOLLM2, "qwen1.5b": QWEN_1_5B, "tiny": TINY}


def model_shapes(m: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF-style tensor names and shapes of a Llama/Qwen-like decoder (``m``: vocab, hidden, inter, layers, kv)."""
    h, out = m["hidden"], [("model.embed_tokens.weight", (m["vocab"], m["hidden"]))]
    for i in range(m["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (m["kv"], h)),
                (p + "self_attn.v_proj.weight", (m["kv"], h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (m["inter"], h)), (p + "mlp.up_proj.weight", (m["inter"], h)),
                (p + "mlp.down_proj.weight", (h, m["inter"])), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,))]


def version_tensors(shapes, version: int, device: str = DEVICE) -> list[tuple[str, torch.Tensor]]:
    """Deterministic bf16 weights of ``version`` (same seed → same bytes on every process)."""
    gen = torch.Generator(device=device).manual_seed(1000 + version)
    return [(n, torch.randn(s, generator=gen, device=device).to(torch.bfloat16)) for n, s in shapes]


def checksum_parity() -> dict:
    """``device_checksum`` CUDA vs CPU over dtypes and awkward sizes; throughput on a 1 GiB tensor."""
    from gyre.proto.manifest import _STEP_WORDS, device_checksum

    gen = torch.Generator().manual_seed(7)
    cases = [(torch.float32, (3, 5)), (torch.bfloat16, (7,)), (torch.float16, (3,)), (torch.bfloat16, (4097, 33)),
             (torch.float32, (_STEP_WORDS * 2 + 13,)), (torch.float16, (1, 0))]
    mismatches = []
    for dtype, shape in cases:
        cpu = torch.randn(shape, generator=gen).to(dtype)
        if device_checksum(cpu) != device_checksum(cpu.to("cuda")):
            mismatches.append(f"{dtype} {list(shape)}")
    big = torch.randn(1 << 29, device="cuda").to(torch.bfloat16)  # 1 GiB
    device_checksum(big)
    _sync()
    start = time.perf_counter()
    for _ in range(3):
        device_checksum(big)
    seconds = (time.perf_counter() - start) / 3
    return {"checksum_parity": not mismatches, "checksum_mismatches": mismatches,
            "checksum_gb_s": round(big.numel() * 2 / seconds / 1e9, 1)}


def _nccl_env(name: str) -> None:
    os.environ.update({"NCCL_HOSTID": f"gyre-bench-{name}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"})


def _store(port: int, world: int):
    """The bench's TCPStore: with ``port`` 0 the learner's, on a port the OS picks (``store.port``: the
    receivers are started after it is bound, so no other process can take it first); else a receiver's client
    of the store on ``port``."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, port == 0, timeout=datetime.timedelta(seconds=300),
                         wait_for_workers=False)


def receiver_main(rank: int, world: int, store_port: int, weights_address: str, model: str, bucket_mb: float) -> None:
    """Rollout receiver process: ``NcclTransport`` (group or gRPC); raw rounds in a group of its own on request."""
    _nccl_env(f"rollout-{rank}")
    from gyre.proto.weight_transport import NcclTransportConfig
    from gyre.services.rollout.transport.nccl import NcclTransport

    store = _store(store_port, world)
    raw_group = _raw_group(store, rank, world)
    shapes = model_shapes(MODELS[model])
    exact_versions = {0, EXACT_AFTER_CORRUPT}

    def on_version(version, tensors, timeline):
        exact = ""
        if version in exact_versions:  # bit-exact against the learner's deterministic weights
            ref = version_tensors(shapes, version)
            exact = str(all(torch.equal(a.to(DEVICE), b) for (_, a), (_, b) in zip(tensors, ref)))
        store.set(f"delivered/{rank}/{version}", json.dumps({
            "exact": exact, "group": transport.group_versions, "grpc": transport.grpc_versions}))

    cfg = NcclTransportConfig(backend=BACKEND, bucket_mb=bucket_mb, backoff_s=0.2)
    transport = NcclTransport(cfg, weights_address, on_version, name=f"rollout-{rank}").start()
    numel = sum(_numel(s) for _, s in shapes)
    flat = torch.empty(numel, dtype=torch.bfloat16, device=DEVICE)
    # A TCPStore client serialises its calls: this thread's blocking get needs its own client, or the
    # transport thread's ``set`` in on_version would wait behind it.
    waiter = _store(store_port, world)
    round_ = 0
    while True:
        cmd = waiter.get(f"raw/{round_}").decode()  # blocks until the learner asks
        if cmd == "stop":
            break
        _broadcast(raw_group, flat)
        _sync()
        waiter.set(f"raw_done/{rank}/{round_}", "1")
        round_ += 1
    transport.stop()


BACKEND = "gloo" if CPU_DRY_RUN else "nccl"
EXACT_AFTER_CORRUPT = 10_000
"""The corrupted version's number (its bytes are checked bit-exact after the gRPC fallback)."""


def _raw_group(store, rank: int, world: int):
    """The baseline's own group of the same processes (``open_group``, the backend the transport uses)."""
    import torch.distributed as dist

    from gyre.proto.broadcast import open_group

    if not CPU_DRY_RUN:
        torch.cuda.set_device(0)
    return open_group(BACKEND, dist.PrefixStore("raw", store), rank, world, datetime.timedelta(seconds=300))


def _broadcast(group, tensor) -> None:
    from gyre.proto.broadcast import group_broadcast

    group_broadcast(group)(tensor, 0).wait()


def _wait_keys(store, keys: list[str]) -> list[str]:
    store.wait(keys, datetime.timedelta(seconds=300))
    return [store.get(k).decode() for k in keys]


def learner_main(receivers: int, rounds: int, model: str, bucket_mb: float) -> dict:
    """Learner process: publisher + weight server + ``WeightGroup`` behind a ``BackgroundPublisher``; spawns
    ``receivers`` receiver processes."""
    _nccl_env("learner")
    from types import SimpleNamespace

    import gyre.services.learner.weight_group as weight_group
    from gyre.learner.background_publish import BackgroundPublisher
    from gyre.learner.publisher import WeightPublisher
    from gyre.proto.weight_transport import NcclTransportConfig
    from gyre.services.learner import weight_server

    pub, members = WeightPublisher(), weight_group.GroupMembers()
    server, port = weight_server.serve(pub, members=members)
    cfg = NcclTransportConfig(backend=BACKEND, bucket_mb=bucket_mb)
    group = weight_group.WeightGroup(cfg, pub, members)
    background = BackgroundPublisher(pub, SimpleNamespace(published=lambda v, n: None), group=group)
    world = receivers + 1
    store = _store(0, world)
    procs = [subprocess.Popen([sys.executable, "-m", "bench.nccl", "--receiver", str(r), str(world), str(store.port),
                               f"127.0.0.1:{port}", model, str(bucket_mb)], cwd=REPO) for r in range(1, world)]
    raw_group = _raw_group(store, 0, world)
    deadline = time.monotonic() + 300
    while len(members.snapshot()) < receivers:  # every receiver follows the announces: one group takes them all
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(members.snapshot())} of {receivers} receivers followed the learner")
        time.sleep(0.05)
    shapes = model_shapes(MODELS[model])
    nbytes = sum(2 * _numel(s) for _, s in shapes)
    ranks = range(1, world)

    def gyre_round(version: int) -> tuple[float, list[dict]]:
        named = version_tensors(shapes, version)
        _sync()
        start = time.perf_counter()
        background.submit(version, 0, named)
        got = _wait_keys(store, [f"delivered/{r}/{version}" for r in ranks])
        elapsed = time.perf_counter() - start
        background.flush()
        return elapsed, [json.loads(g) for g in got]

    raw_round = 0
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE)

    def raw() -> float:
        nonlocal raw_round
        flat.normal_()
        _sync()
        start = time.perf_counter()
        store.set(f"raw/{raw_round}", "go")
        _broadcast(raw_group, flat)
        _wait_keys(store, [f"raw_done/{r}/{raw_round}" for r in ranks])
        raw_round += 1
        return time.perf_counter() - start

    first_s, first = gyre_round(0)  # warm-up: group formation, NCCL connections, allocator; the bit-exact check
    raw()
    gyre_s, raw_s, ratios = [], [], []
    for i in range(rounds):
        got_s = {}
        for kind in (("gyre", "raw") if i % 2 == 0 else ("raw", "gyre")):
            got_s[kind] = gyre_round(1 + i)[0] if kind == "gyre" else raw()
        gyre_s.append(got_s["gyre"])
        raw_s.append(got_s["raw"])
        ratios.append(got_s["raw"] / got_s["gyre"])

    real = weight_group.group_broadcast

    def corrupting(pg):  # the wire flips one bit of the version's first bucket
        start, flipped = real(pg), []

        def send(t, src):
            if not flipped:
                flipped.append(True)
                t = t.clone()
                t.view(torch.uint8)[0] ^= 1
            return start(t, src)
        return send
    weight_group.group_broadcast = corrupting
    _, bad = gyre_round(EXACT_AFTER_CORRUPT)
    weight_group.group_broadcast = real
    _, after = gyre_round(EXACT_AFTER_CORRUPT + 1)
    store.set(f"raw/{raw_round}", "stop")
    for p in procs:
        p.wait(timeout=120)
    background.close()
    pub.close()
    server.stop(0)
    gb = nbytes / 1e9
    refused = all(b["exact"] == "True" and b["grpc"] == 1 for b in bad)
    back_in_group = all(a["group"] == rounds + 2 and a["grpc"] == 1 for a in after)
    return {"model": model, "version_gb": round(gb, 3), "version_bytes": nbytes, "receivers": receivers,
            "rounds": rounds, "bucket_mb": bucket_mb, "nccl_ratio": round(statistics.median(ratios), 3),
            "nccl_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "gyre_gb_s": round(gb / statistics.median(gyre_s), 2), "raw_gb_s": round(gb / statistics.median(raw_s), 2),
            "first_version_s": round(first_s, 3), "groups_formed": group.reforms,
            "bit_exact": all(f["exact"] == "True" for f in first),
            "corrupt_refused": refused and back_in_group, "receiver_group_versions": [a["group"] for a in after],
            "exit_codes": [p.returncode for p in procs]}


def _sync() -> None:
    if not CPU_DRY_RUN:
        torch.cuda.synchronize()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="SmolLM2-135M shapes, 1 receiver, 5 rounds")
    parser.add_argument("--model", choices=sorted(MODELS), default=None)
    parser.add_argument("--receivers", type=int, default=None)
    parser.add_argument("--bucket-mb", type=float, default=None, help="broadcast bucket size, MiB (default 256)")
    parser.add_argument("--receiver", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        r, world, port, address, model, bucket_mb = args.receiver
        receiver_main(int(r), int(world), int(port), address, model, float(bucket_mb))
        return
    if CPU_DRY_RUN:
        result = {"device": "cpu (gloo dry run)"}
    elif not torch.cuda.is_available():
        raise SystemExit("bench.nccl needs a CUDA GPU (torch.cuda.is_available() is False here)")
    else:
        result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), **checksum_parity()}
    model = args.model or ("smollm2" if args.quick else "qwen1.5b")
    bucket_mb = args.bucket_mb or (0.01 if model == "tiny" else 256.0)  # tiny: ~0.3 MB, several buckets still
    result.update(learner_main(args.receivers or (1 if args.quick else 2), 5 if args.quick else 9, model, bucket_mb))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
