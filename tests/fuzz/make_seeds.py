#!/usr/bin/env python3
"""Writes the seed corpora (corpus/<target>/) and regression inputs (regressions/<target>/) of
the fuzz targets. Deterministic; run from anywhere:  python3 tests/fuzz/make_seeds.py
The outputs are committed (small); re-run only to change them."""
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
rng = random.Random(1234)


def write(kind, target, name, data):
    d = os.path.join(HERE, kind, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# ---- GGUF ----------------------------------------------------------------------------------------
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf(n_tokens=8, dim=8, hidden=16, heads=2, kv_heads=1, ctx=16, extra_kv=b"", n_extra=0, arch="llama"):
    kv = []
    kv.append(gstr("general.architecture") + struct.pack("<I", 8) + gstr(arch))
    for k, v in [("context_length", ctx), ("embedding_length", dim), ("feed_forward_length", hidden),
                 ("block_count", 1), ("attention.head_count", heads), ("attention.head_count_kv", kv_heads)]:
        kv.append(gstr(arch + "." + k) + struct.pack("<II", 4, v))
    kv.append(gstr(arch + ".attention.layer_norm_rms_epsilon") + struct.pack("<If", 6, 1e-5))
    kv.append(gstr("tokenizer.ggml.model") + struct.pack("<I", 8) + gstr("llama"))
    toks = ["<unk>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(max(0, n_tokens - 3))]
    toks = toks[:n_tokens]
    kv.append(gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, len(toks)) + b"".join(gstr(t) for t in toks))
    kv.append(gstr("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, len(toks)) + b"".join(struct.pack("<f", 0.0) for _ in toks))
    kv.append(gstr("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 5, len(toks)) + b"".join(struct.pack("<i", 1) for _ in toks))
    hd = dim // heads
    tensors = [("token_embd.weight", [dim, n_tokens]), ("output_norm.weight", [dim])]
    for n, dims in [("attn_norm", [dim]), ("attn_q", [dim, dim]), ("attn_k", [dim, kv_heads * hd]),
                    ("attn_v", [dim, kv_heads * hd]), ("attn_output", [dim, dim]), ("ffn_norm", [dim]),
                    ("ffn_gate", [dim, hidden]), ("ffn_down", [hidden, dim]), ("ffn_up", [dim, hidden])]:
        tensors.append(("blk.0." + n + ".weight", dims))
    align = 32
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv) + n_extra) + b"".join(kv) + extra_kv
    info, data, off = b"", b"", 0
    for name, dims in tensors:
        n = 1
        for x in dims:
            n *= x
        info += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", x) for x in dims)
        info += struct.pack("<IQ", 0, off)
        blob = b"".join(struct.pack("<f", rng.uniform(-0.5, 0.5)) for _ in range(n))
        blob += b"\0" * ((-len(blob)) % align)
        data += blob
        off += len(blob)
    out = head + info
    out += b"\0" * ((-len(out)) % align)
    return out + data


write("corpus", "gguf", "tiny.gguf", gguf())
write("corpus", "gguf", "tiny_gqa.gguf", gguf(n_tokens=12, dim=16, hidden=24, heads=4, kv_heads=2))
write("regressions", "gguf", "one_token.gguf", gguf(n_tokens=1))
write("regressions", "gguf", "bos_out_of_range.gguf",
      gguf(extra_kv=gstr("tokenizer.ggml.bos_token_id") + struct.pack("<II", 4, 1000), n_extra=1))
nan_types = gguf()
write("regressions", "gguf", "token_type_nan.gguf", nan_types.replace(
    gstr("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 5, 8),
    gstr("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 6, 8)).replace(
    struct.pack("<i", 1) * 8, struct.pack("<f", float("nan")) * 8, 1))


# ---- llama2.c ------------------------------------------------------------------------------------
def llama2c_v0(dim=8, hidden=16, layers=1, heads=2, kv_heads=1, vocab=8, seq=4):
    hd = dim // heads
    kv = kv_heads * hd
    V = abs(vocab)
    floats = (V * dim + layers * dim + layers * dim * dim + 2 * layers * kv * dim + layers * dim * dim +
              layers * dim + 3 * layers * hidden * dim + dim + seq * hd + (V * dim if vocab < 0 else 0))
    return struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab, seq) + b"".join(
        struct.pack("<f", rng.uniform(-0.3, 0.3)) for _ in range(floats))


write("corpus", "llama2c", "tiny_v0.bin", llama2c_v0())
write("corpus", "llama2c", "tiny_v0_untied.bin", llama2c_v0(vocab=-8))
write("regressions", "llama2c", "vocab_int_min.bin", struct.pack("<7i", 64, 172, 5, 8, 4, -2**31, 512) + b"\0" * 256)
v2 = b"ak42" + struct.pack("<i", 2) + struct.pack("<7i", 8, 16, 1, 2, 1, 8, 4) + struct.pack("<Bi", 1, 32)
write("corpus", "llama2c", "v2_header.bin", v2 + b"\0" * (256 - len(v2)))

# ---- tokenizer -----------------------------------------------------------------------------------
tok128 = open(os.path.join(ROOT, "models", "tok128.bin"), "rb").read()
write("corpus", "tokenizer", "tok128.bin", struct.pack("<H", 127) + tok128)


def tokfile(pieces, max_len=None):
    max_len = max_len or max(1, max(len(p) for p in pieces))
    return struct.pack("<i", max_len) + b"".join(struct.pack("<fi", 0.0, len(p)) + p for p in pieces)


write("corpus", "tokenizer", "merges.bin", struct.pack("<H", 7) + tokfile([b"<unk>", b"<s>", b"</s>", b"a", b"b", b"ab", b" ", b"ab "]))
write("regressions", "tokenizer", "one_token.bin", struct.pack("<H", 0) + tokfile([b"a"]))
write("regressions", "tokenizer", "two_tokens.bin", struct.pack("<H", 1) + tokfile([b"a", b"b"]))

# ---- traces --------------------------------------------------------------------------------------
def trace(prompts=3, steps=40, layers=3, model="m", end=True):
    lines = ["# thinkv-sparsity-trace v2", "# model: " + model, "# num_layers: %d" % layers,
             "prompt,step," + ",".join("l%d" % i for i in range(layers))]
    rows = 0
    for p in range(prompts):
        for s in range(steps):
            lines.append("p%d,%d," % (p, s) + ",".join("%.3g" % rng.random() for _ in range(layers)))
            rows += 1
    if end:
        lines.append("# end: %d rows" % rows)
    return "\n".join(lines) + "\n"


write("corpus", "trace", "small.csv", trace())
write("corpus", "trace", "one_prompt.csv", trace(prompts=1, steps=64, layers=2))
write("regressions", "trace", "cr_in_model.csv", "# thinkv-sparsity-trace v2\n# model: a\rb\n# num_layers: 1\nprompt,step,l0\np,0,0.5\n# end: 1 rows\n")
write("regressions", "trace", "cr_in_id.csv", "# thinkv-sparsity-trace v2\n# model: m\n# num_layers: 1\nprompt,step,l0\na\rb,0,0.5\n# end: 1 rows\n")
write("regressions", "trace", "truncated.csv", trace(end=False))

# ---- calibration files ---------------------------------------------------------------------------
write("corpus", "calibration", "testbed-calib.json", open(os.path.join(ROOT, "models", "testbed-calib.json")).read())
write("corpus", "calibration", "two_types.json",
      '{"format": "thinkv-calibration", "version": 1, "model": {"name": "m", "num_layers": 4}, "thresholds": [0.5],'
      ' "layers": [1, 2], "tau": 64, "num_types": 2, "band_types": ["E", "T"], "provenance": {"prompts": 3, "steps": 900,'
      ' "date": "2026-01-01T00:00:00Z", "method": "kde-silverman", "bandwidth_rule": "x", "tool": "t"}}\n')

# ---- JSON ----------------------------------------------------------------------------------------
write("corpus", "calibration", "object.json", '{"a": [1, 2.5, -3e-7, true, null], "b": {"c": "\\u00e9\\n"}, "d": ""}')
write("corpus", "calibration", "deep.json", "[" * 40 + "]" * 40)
write("corpus", "calibration", "numbers.json", "[0, -0, 1e308, 2.2250738585072014e-308, 123456789012345678901234567890]")

# ---- cache arguments -----------------------------------------------------------------------------
for i, args in enumerate([
        ["--mode", "thinkv", "--budget", "64", "--segment", "32"],
        ["--mode", "h2o", "--budget", "16", "--prompt-tokens", "9"],
        ["--mode", "rkv", "--budget", "24", "--compress-prompt"],
        ["--mode", "tbq", "--precision", "R8E4T2", "--group", "8"],
        ["--mode", "kivi2"],
        ["--mode", "thinkv-first", "--budget", "48", "--tau", "16", "--segment", "16"],
        ["--mode", "streamingllm", "--budget", "8"],
        ["--mode", "full"]]):
    write("corpus", "cache_args", "args%d.txt" % i, "\n".join(args))
write("regressions", "cache_args", "int_overflow.txt", "\n".join(["--budget", "2147483647", "--segment", "2147483632", "--tau", "2147483632"]))
write("regressions", "cache_args", "budget_zero.txt", "\n".join(["--mode", "thinkv", "--budget", "0"]))
# ---- sequence states (fuzz_sequence_state's structured input; see its file comment) -------------
def seq_state(tokens, seed, reseal=False, truncate=None, edits=()):
    flags = (1 if reseal else 0) | (2 if truncate is not None else 0)
    t = truncate or 0
    out = bytes([tokens, seed, flags, t & 0xFF, (t >> 8) & 0xFF])
    for at, x in edits:
        out += struct.pack("<IB", at, x)
    return out


write("corpus", "sequence_state", "empty.bin", seq_state(0, 1))
write("corpus", "sequence_state", "short.bin", seq_state(10, 2))
write("corpus", "sequence_state", "evicted.bin", seq_state(100, 3))
write("corpus", "sequence_state", "edited_resealed.bin", seq_state(60, 4, reseal=True, edits=[(40, 1), (300, 0x80), (2000, 7)]))
write("corpus", "sequence_state", "edited.bin", seq_state(60, 5, edits=[(1000, 2)]))
write("corpus", "sequence_state", "truncated.bin", seq_state(40, 6, truncate=700))
write("corpus", "sequence_state", "truncated_resealed.bin", seq_state(90, 7, reseal=True, truncate=5000))
# A resealed edit of a staged K/V float's low mantissa bits: the load accepted a value the BF16
# staging buffer cannot hold and saved back other bytes (now kCorruptData).
write("regressions", "sequence_state", "staged_not_bf16.bin", bytes([9, 0, 21, 0, 7, 83, 3, 136, 90, 7, 3, 136, 7, 136, 7, 40, 6, 6, 2, 2]))
# A resealed state with a nonzero byte in a slot past its block's fill (it loaded, and saved
# back zeros there).
write("regressions", "sequence_state", "unwritten_slot_bytes.bin",
      bytes([0x3C, 0x04, 0x01, 0x00, 0x09, 0x00, 0x00, 0x80, 0xD0, 0x07, 0x00, 0x00, 0x07]))
# A resealed state whose unwritten slot says position -2 (a save writes segment 0, position -1
# there; it loaded, and saved back -1).
write("regressions", "sequence_state", "unwritten_slot_metadata.bin",
      bytes([0x3C, 0x04, 0x01, 0x00, 0x00, 0xD8, 0xFF, 0xFF, 0xFF, 0x04, 0x00, 0x01, 0x2C, 0x00, 0x01, 0x70]))
# A resealed state in which one slot names another record of its stream (an XOR of 2 at byte
# 337 of 200 decoded tokens' state): the names no longer in the order a save numbers records
# (first use), it loaded and saved back renumbered (now kCorruptData).
write("regressions", "sequence_state", "record_numbering.bin", bytes([100, 1, 1, 0, 0, 0x51, 0x01, 0x00, 0x00, 0x02]))
print("seeds written under", HERE)
