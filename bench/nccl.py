"""NCCL weight transport on a CUDA machine: ``python -m bench.nccl [--quick]`` (needs a GPU; last line JSON).

Runs gyre's NCCL path end to end except vLLM's worker glue: the learner process holds a ``WeightPublisher``
behind a real weight server (``WeightService.Announce`` over gRPC) and sends each policy version with
``NcclWeightSender`` over a ``torch.distributed`` NCCL group; each rollout receiver is its own process whose
``NcclTransport`` follows the announces and takes every version with ``receive_verified`` into CUDA buffers
(the body of ``rollout.weights.load_broadcast_verified``, minus the model load).

Reported:
- ``checksum_parity``: ``device_checksum`` on CUDA equals the CPU value (bf16/fp16/fp32, odd byte counts,
  tensors of several 2**24-word steps) — learner and rollouts may sit on different devices.
- ``checksum_gb_s``: ``device_checksum`` throughput on this GPU (GB/s, one 1 GiB bf16 tensor).
- ``nccl_ratio``: GB/s of a version delivered to every receiver by gyre (checksums on the learner's GPU,
  manifest over gRPC, broadcast, every checksum verified on every receiver) ÷ a raw NCCL broadcast of the
  same tensors in the same group; rounds alternate, median of per-round ratios.
- ``corrupt_refused``: a version whose broadcast flips one bit is refused by every receiver (old version
  kept, not retried) and the next version lands; ``bit_exact``: a delivered version equals the learner's.

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


def _group(store, rank: int, world: int):
    """Join the bench's process group (gloo in ``CPU_DRY_RUN``, else NCCL) over ``store``; returns ``store``."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    if CPU_DRY_RUN:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=timeout)
        return store
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=timeout, device_id=torch.device("cuda", 0))
    return store


def receiver_main(rank: int, world: int, store_port: int, weights_address: str, model: str) -> None:
    """Rollout receiver process: ``NcclTransport`` + ``receive_verified`` into CUDA; raw rounds on request."""
    _nccl_env(f"rollout-{rank}")
    import torch.distributed as dist

    from gyre.proto.broadcast import receive_verified, torch_distributed_broadcast
    from gyre.proto.weight_transport import NcclTransportConfig
    from gyre.services.rollout.transport.nccl import NcclTransport

    store = _group(_store(store_port, world), rank, world)
    shapes = model_shapes(MODELS[model])
    bcast = torch_distributed_broadcast()

    def on_version(version, manifest, timeline):
        start = time.perf_counter()
        tensors = receive_verified(bcast, manifest.tensors, DEVICE)
        _sync()
        exact = ""
        if version == 0:  # bit-exact against the learner's deterministic weights
            ref = version_tensors(shapes, version)
            exact = str(all(torch.equal(a, b) for (_, a), (_, b) in zip(ref, tensors)))
        store.set(f"delivered/{rank}/{version}", json.dumps({"s": time.perf_counter() - start, "exact": exact}))

    cfg = NcclTransportConfig(master_address="127.0.0.1", master_port=store_port, world_size=world,
                              rank_offset=1, backoff_s=0.2)
    transport = NcclTransport(cfg, weights_address, on_version, name=f"r{rank}", require_gpu=not CPU_DRY_RUN).start()
    bufs = [torch.empty(s, dtype=torch.bfloat16, device=DEVICE) for _, s in shapes]
    # A TCPStore client serialises its calls: this thread's blocking get needs its own client, or the
    # transport thread's ``set`` in on_version would wait behind it.
    waiter = dist.TCPStore("127.0.0.1", store_port, world, False, timeout=datetime.timedelta(seconds=300))
    round_ = 0
    while True:
        cmd = waiter.get(f"raw/{round_}").decode()  # blocks until the learner asks
        waiter.set(f"errors/{rank}/{round_}", str(transport.errors))
        if cmd == "stop":
            break
        for b in bufs:
            dist.broadcast(b, src=0)
        _sync()
        waiter.set(f"raw_done/{rank}/{round_}", "1")
        round_ += 1
    transport.stop()
    dist.destroy_process_group()


def _wait_keys(store, keys: list[str]) -> list[str]:
    store.wait(keys, datetime.timedelta(seconds=300))
    return [store.get(k).decode() for k in keys]


def learner_main(receivers: int, rounds: int, model: str) -> dict:
    """Learner process: publisher + weight server + NCCL sender; spawns ``receivers`` receiver processes."""
    _nccl_env("learner")
    import torch.distributed as dist

    from gyre.learner.publisher import WeightPublisher
    from gyre.services.learner import weight_server
    from gyre.proto.broadcast import torch_distributed_broadcast
    from gyre.services.learner.weight_broadcast import NcclWeightSender

    pub = WeightPublisher()
    server, port = weight_server.serve(pub)
    world = receivers + 1
    store = _store(0, world)
    procs = [subprocess.Popen([sys.executable, "-m", "bench.nccl", "--receiver", str(r), str(world), str(store.port),
                               f"127.0.0.1:{port}", model], cwd=REPO) for r in range(1, world)]
    _group(store, 0, world)
    shapes = model_shapes(MODELS[model])
    nbytes = sum(2 * _numel(s) for _, s in shapes)
    clean = torch_distributed_broadcast()
    sender = NcclWeightSender(pub, clean)
    ranks = range(1, world)

    def gyre_round(version: int, broadcast=None) -> tuple[float, list[dict]]:
        named = version_tensors(shapes, version)
        _sync()
        start = time.perf_counter()
        (NcclWeightSender(pub, broadcast) if broadcast else sender).send(version, named)
        if broadcast:
            _sync()
            return time.perf_counter() - start, []
        got = _wait_keys(store, [f"delivered/{r}/{version}" for r in ranks])
        return time.perf_counter() - start, [json.loads(g) for g in got]

    raw_round = 0

    def raw() -> float:
        nonlocal raw_round
        named = version_tensors(shapes, 10_000 + raw_round)
        _sync()
        start = time.perf_counter()
        store.set(f"raw/{raw_round}", "go")
        for _, t in named:
            dist.broadcast(t, src=0)
        _wait_keys(store, [f"raw_done/{r}/{raw_round}" for r in ranks])
        raw_round += 1
        return time.perf_counter() - start

    first_s, first = gyre_round(0)  # warm-up: NCCL connections, allocator; also the bit-exact check
    raw()
    gyre_s, raw_s, ratios, recv_s = [], [], [], []
    for i in range(rounds):
        order = ("gyre", "raw") if i % 2 == 0 else ("raw", "gyre")
        got_s = {}
        for kind in order:
            if kind == "gyre":
                got_s["gyre"], reports = gyre_round(1 + i)
                recv_s += [r["s"] for r in reports]
            else:
                got_s["raw"] = raw()
        gyre_s.append(got_s["gyre"])
        raw_s.append(got_s["raw"])
        ratios.append(got_s["raw"] / got_s["gyre"])

    def corrupting(t: torch.Tensor, src: int) -> None:  # the wire flips one bit of the last norm
        if t.dim() == 1 and t.numel() == shapes[-1][1][0] and not getattr(corrupting, "done", False):
            t = t.clone()
            t.view(torch.int16)[0] ^= 1
            corrupting.done = True
        clean(t, src)

    def refusals() -> list[int]:  # receivers report their transport's refusal count at each raw round
        n = raw_round
        raw()
        return [int(e) for e in _wait_keys(store, [f"errors/{r}/{n}" for r in ranks])]

    bad = rounds + 1
    errors_before = refusals()
    gyre_round(bad, broadcast=corrupting)
    time.sleep(1.0)  # > backoff: a transport that retried the refused version would now block in a broadcast
    _, after = gyre_round(bad + 1)
    errors_after = refusals()
    delivered_bad = [store.check([f"delivered/{r}/{bad}"]) for r in ranks]
    store.set(f"raw/{raw_round}", "stop")
    for p in procs:
        p.wait(timeout=120)
    pub.close()
    server.stop(0)
    dist.destroy_process_group()
    gb = nbytes / 1e9
    return {"model": model, "version_gb": round(gb, 3), "version_bytes": nbytes, "receivers": receivers,
            "rounds": rounds, "nccl_ratio": round(statistics.median(ratios), 3),
            "nccl_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "gyre_gb_s": round(gb / statistics.median(gyre_s), 2), "raw_nccl_gb_s": round(gb / statistics.median(raw_s), 2),
            "receiver_receive_verify_s": round(statistics.median(recv_s), 3), "first_version_s": round(first_s, 3),
            "bit_exact": first[0]["exact"] == "True" and all(f["exact"] == "True" for f in first),
            "corrupt_refused": (errors_after == [e + 1 for e in errors_before] and not any(delivered_bad)
                                and len(after) == receivers),
            "receiver_errors": errors_after, "exit_codes": [p.returncode for p in procs]}


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
    parser.add_argument("--receiver", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        r, world, port, address, model = args.receiver
        receiver_main(int(r), int(world), int(port), address, model)
        return
    if CPU_DRY_RUN:
        result = {"device": "cpu (gloo dry run)"}
    elif not torch.cuda.is_available():
        raise SystemExit("bench.nccl needs a CUDA GPU (torch.cuda.is_available() is False here)")
    else:
        result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), **checksum_parity()}
    model = args.model or ("smollm2" if args.quick else "qwen1.5b")
    result.update(learner_main(args.receivers or (1 if args.quick else 2), 5 if args.quick else 9, model))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
