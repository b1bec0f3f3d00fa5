#!/usr/bin/env python3
"""Decode-attention baseline: torch.nn.functional.scaled_dot_product_attention on dense BF16 KV.

Times PyTorch's SDPA on the decode shapes of bench_paged_attention (Llama-3-8B attention:
32 query heads, 8 KV heads, head_dim 128, one query token), over contiguous (dense, uncompressed)
KV tensors [batch, 8, L, 128] in BF16: the FullKV reference point for ThinKV's paged kernel.

GQA: enable_gqa=True when this torch supports it; otherwise K and V are repeat_interleave'd to 32
heads BEFORE timing (the timed call then reads 4x the KV bytes; the JSON says which mode ran).

Timing: CUDA events around each call, warm-up calls first, a 256 MiB buffer written between
repeats (outside the timed region) so every call reads the KV from HBM, median of >= 20 repeats.
Bytes = K + V read (batch * 8 * L * 128 * 2 bytes * 2) + q read + out written (batch * 32 * 128 * 2
each); GB/s = bytes / median; pct_of_4300 = GB/s / 4300 (H200 HBM3e peak 4.8 TB/s; 4.3 TB/s is
the ceiling the project's benchmarks use).

Backends: the default dispatch, then each of FLASH_ATTENTION, EFFICIENT_ATTENTION,
CUDNN_ATTENTION and MATH forced with torch.nn.attention.sdpa_kernel; one that cannot run a shape
(unsupported, out of memory) is recorded with its error. The backend the default dispatch picks
is read from torch._fused_sdp_choice when this torch has it, and the CUDA kernels it launched are
listed (torch.profiler), so the choice can be checked either way.

Usage: python3 bench/torch_sdpa_decode.py --out sdpa.json [--repeats 30] [--max-kv-gib 40]
"""

import argparse
import json
import math
import statistics
import sys
import time
import warnings

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - torch is on the GPU machine only
    print("torch_sdpa_decode: PyTorch is not installed", file=sys.stderr)
    sys.exit(77)

NUM_Q_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
CEILING_GBPS = 4300.0
FLUSH_BYTES = 256 * 1024 * 1024
BACKEND_NAMES = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--kv-lens", default="512,4096,32768")
    ap.add_argument("--repeats", type=int, default=30, help="timed repeats (at least 20)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-kv-gib", type=float, default=40.0,
                    help="skip shapes whose KV tensors (as timed) exceed this")
    ap.add_argument("--no-forced-backends", action="store_true",
                    help="time the default dispatch only")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.repeats = max(a.repeats, 20)
    a.batches = [int(x) for x in a.batches.split(",") if x]
    a.kv_lens = [int(x) for x in a.kv_lens.split(",") if x]
    return a


def gqa_supported():
    """True when F.scaled_dot_product_attention accepts enable_gqa (torch >= 2.5)."""
    q = torch.zeros(1, 4, 1, 8, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 4, 8, device="cuda", dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        torch.cuda.synchronize()
        return True
    except TypeError:
        return False
    except RuntimeError:
        return False


def backend_context(name):
    """A context manager forcing one SDPA backend, or None when this torch cannot force it."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        SDPBackend = None
    if SDPBackend is not None:
        if not hasattr(SDPBackend, name):
            return None
        return sdpa_kernel(getattr(SDPBackend, name))
    # torch < 2.3: the older flag API (no cuDNN backend there).
    flags = {"FLASH_ATTENTION": "enable_flash", "EFFICIENT_ATTENTION": "enable_mem_efficient",
             "MATH": "enable_math"}
    if name not in flags or not hasattr(torch.backends.cuda, "sdp_kernel"):
        return None
    kw = {"enable_flash": False, "enable_mem_efficient": False, "enable_math": False}
    kw[flags[name]] = True
    return torch.backends.cuda.sdp_kernel(**kw)


def default_choice(q, k, v, use_gqa):
    """Name of the backend the default dispatch picks (torch._fused_sdp_choice), or None."""
    fn = getattr(torch, "_fused_sdp_choice", None)
    if fn is None:
        return None
    try:
        idx = fn(q, k, v, None, 0.0, False, enable_gqa=True) if use_gqa else fn(q, k, v)
    except Exception:  # noqa: BLE001 - private API, signature differs across versions
        try:
            idx = fn(q, k, v)
        except Exception:  # noqa: BLE001
            return None
    try:
        from torch.nn.attention import SDPBackend
        return SDPBackend(int(idx)).name
    except Exception:  # noqa: BLE001
        names = {0: "MATH", 1: "FLASH_ATTENTION", 2: "EFFICIENT_ATTENTION", 3: "CUDNN_ATTENTION"}
        return names.get(int(idx), str(idx))


def launched_kernels(fn):
    """Names of the CUDA kernels one call launches (torch.profiler), or [] when unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the profiler's notes are not about the kernels
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
        names = []
        for ev in prof.key_averages():
            dev_type = getattr(ev, "device_type", None)
            if dev_type is not None and "CUDA" not in str(dev_type):
                continue
            if ev.key not in names:
                names.append(ev.key)
        return names[:8]
    except Exception:  # noqa: BLE001
        return []


def time_call(fn, flush, warmup, repeats):
    """Median microseconds of fn() over `repeats` calls, L2 flushed before each one."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(repeats):
        flush.fill_(r & 0xFF)  # untimed: evicts the KV from L2
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def entry(median_us, nbytes):
    gbs = nbytes / (median_us * 1e-6) / 1e9
    return {"median_us": round(median_us, 3), "gb_s": round(gbs, 1),
            "pct_of_4300": round(100.0 * gbs / CEILING_GBPS, 2)}


def short_error(e):
    msg = str(e).strip().splitlines()
    return (type(e).__name__ + ": " + (msg[0] if msg else ""))[:200]


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        print("torch_sdpa_decode: no CUDA device, skipping (exit 77)", file=sys.stderr)
        return 77
    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    use_gqa = gqa_supported()
    gqa_mode = "enable_gqa" if use_gqa else "repeat_interleave (KV expanded to 32 heads before timing)"
    kv_heads_timed = NUM_KV_HEADS if use_gqa else NUM_Q_HEADS
    props = torch.cuda.get_device_properties(dev)
    meta = {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu_name": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "gqa_mode": gqa_mode,
        "num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
        "dtype": "bfloat16", "query_len": 1,
        "bytes_formula": "batch*8*L*128*2*2 (K+V, unexpanded) + 2*batch*32*128*2 (q, out)",
        "ceiling_gb_s": CEILING_GBPS, "repeats": args.repeats, "warmup": args.warmup,
        "l2_flush_bytes": FLUSH_BYTES,
    }
    print("torch %s, CUDA %s, %s, GQA via %s" % (meta["torch_version"], meta["cuda_version"],
                                                 meta["gpu_name"], gqa_mode))
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    results = []
    hdr = "%6s %7s %10s %11s %8s %7s  %-20s %s" % ("batch", "kv_len", "KV MiB", "median_us", "GB/s",
                                                  "%4.3TB", "default backend", "forced backends (us)")
    print(hdr)
    print("-" * len(hdr))
    for kv_len in args.kv_lens:
        for batch in args.batches:
            kv_bytes = batch * NUM_KV_HEADS * kv_len * HEAD_DIM * 2 * 2
            timed_kv_bytes = batch * kv_heads_timed * kv_len * HEAD_DIM * 2 * 2
            qo_bytes = 2 * batch * NUM_Q_HEADS * HEAD_DIM * 2
            nbytes = kv_bytes + qo_bytes
            rec = {"batch": batch, "kv_len": kv_len, "bytes": nbytes, "kv_bytes": kv_bytes,
                   "gqa_mode": "enable_gqa" if use_gqa else "repeat_interleave"}
            if timed_kv_bytes > args.max_kv_gib * 2**30:
                rec["skipped"] = "KV %.1f GiB > --max-kv-gib %g" % (timed_kv_bytes / 2**30, args.max_kv_gib)
                results.append(rec)
                print("%6d %7d %10.0f  skipped (%s)" % (batch, kv_len, timed_kv_bytes / 2**20, rec["skipped"]))
                continue
            q = k = v = out_ref = None
            try:
                q = torch.randn(batch, NUM_Q_HEADS, 1, HEAD_DIM, device=dev, dtype=torch.bfloat16)
                k = torch.randn(batch, NUM_KV_HEADS, kv_len, HEAD_DIM, device=dev, dtype=torch.bfloat16)
                v = torch.randn(batch, NUM_KV_HEADS, kv_len, HEAD_DIM, device=dev, dtype=torch.bfloat16)
                if not use_gqa:
                    k = k.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1).contiguous()
                    v = v.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1).contiguous()
                torch.cuda.synchronize()
            except RuntimeError as e:  # out of memory
                rec["skipped"] = "allocation failed: " + short_error(e)
                results.append(rec)
                q = k = v = None
                torch.cuda.empty_cache()
                print("%6d %7d  skipped (%s)" % (batch, kv_len, rec["skipped"]))
                continue

            def call():
                if use_gqa:
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                return F.scaled_dot_product_attention(q, k, v)

            try:
                out_ref = call()
                med = time_call(call, flush, args.warmup, args.repeats)
                rec.update(entry(med, nbytes))
                rec["backend"] = default_choice(q, k, v, use_gqa)
                rec["kernels"] = launched_kernels(call)
            except RuntimeError as e:
                rec["error"] = short_error(e)
                torch.cuda.empty_cache()
            rec["backends"] = {}
            if not args.no_forced_backends:
                for name in BACKEND_NAMES:
                    ctx = backend_context(name)
                    if ctx is None:
                        rec["backends"][name] = {"error": "not available in this torch"}
                        continue
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")  # SDPA says why a backend refuses
                        try:
                            with ctx:
                                out = call()
                                bmed = time_call(call, flush, args.warmup, args.repeats)
                            b = entry(bmed, nbytes)
                            if out_ref is not None:
                                diff = float((out.float() - out_ref.float()).abs().max())
                                b["max_abs_diff_vs_default"] = diff if math.isfinite(diff) else str(diff)
                            rec["backends"][name] = b
                            del out
                        except RuntimeError as e:  # unsupported shape/GQA, or out of memory
                            why = [str(w.message).strip().splitlines()[0][:200] for w in caught
                                   if str(w.message).strip()]
                            rec["backends"][name] = {"error": short_error(e), "warnings": why[:3]}
                            torch.cuda.empty_cache()
            results.append(rec)
            forced = " ".join("%s=%s" % (n.split("_")[0].lower(),
                                         ("%.1f" % r["median_us"]) if "median_us" in r else "x")
                              for n, r in rec["backends"].items())
            if "median_us" in rec:
                print("%6d %7d %10.0f %11.1f %8.0f %6.1f%%  %-20s %s" % (
                    batch, kv_len, kv_bytes / 2**20, rec["median_us"], rec["gb_s"], rec["pct_of_4300"],
                    rec.get("backend") or "?", forced))
            else:
                print("%6d %7d %10.0f  error: %s  %s" % (batch, kv_len, kv_bytes / 2**20,
                                                         rec.get("error"), forced))
            sys.stdout.flush()
            del q, k, v, out_ref
            torch.cuda.empty_cache()
    doc = dict(meta)
    doc["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    doc["results"] = results
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print("wrote %s (%d shapes)" % (args.out, len(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
