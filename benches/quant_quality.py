#!/usr/bin/env python3
"""Weight RMSE of refusion's quantizers next to llama.cpp's own, on the same tensors.

llama.cpp's quantizer is called through ggml (`ggml_quantize_chunk`, the function
llama-quantize uses) from the shared library that the `llama-cpp-python` package builds;
both outputs are decoded with gguf-py's independent numpy decoders.

    pip install llama-cpp-python gguf numpy        # builds llama.cpp once (10-20 minutes)
    python3 benches/quant_quality.py --refusion target/release/refusion \
        [--gguf MODEL-f32.gguf --tensors 8] [--types q4_K,q5_K,...]

Without --gguf it uses synthetic Gaussian and heavy-tailed tensors. Not part of CI.
"""
import argparse
import ctypes
import glob
import os
import subprocess
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# Which `refusion quantize --pure` file type yields each tensor type.
FTYPE_FOR = {
    "q2_K": "q2_k", "q3_K": "q3_k_s", "q4_K": "q4_k_s", "q5_K": "q5_k_s", "q6_K": "q6_k",
    "q4_0": "q4_0", "q4_1": "q4_1", "q5_0": "q5_0", "q5_1": "q5_1", "q8_0": "q8_0",
}
GGML_TYPE = {
    "q2_K": T.Q2_K, "q3_K": T.Q3_K, "q4_K": T.Q4_K, "q5_K": T.Q5_K, "q6_K": T.Q6_K,
    "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "q8_0": T.Q8_0,
}


def load_ggml():
    import llama_cpp
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    base = sorted(glob.glob(os.path.join(libdir, "libggml-base.so*")))[0]
    lib = ctypes.CDLL(base)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def llama_quantize(lib, x, qtype):
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    block, tsize = gguf.GGML_QUANT_SIZES[qtype]
    out = np.zeros(rows * n // block * tsize, dtype=np.uint8)
    lib.ggml_quantize_init(int(qtype))
    lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, n, None)
    return out.reshape(rows, n // block * tsize)


def synthetic():
    rng = np.random.default_rng(0)
    return {
        "gauss_4096x256": rng.standard_normal((256, 4096)).astype(np.float32) * 0.02,
        "student3_4096x256": (rng.standard_t(3, (256, 4096)) * 0.02).astype(np.float32),
        "outlier_cols_2048x256": (rng.standard_normal((256, 2048)) * 0.02
                                  * np.where(rng.random(2048) < 0.01, 20, 1)).astype(np.float32),
    }


def from_gguf(path, limit):
    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        if len(t.shape) != 2 or t.tensor_type not in (T.F32, T.F16, T.BF16):
            continue
        x = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(int(t.shape[1]), int(t.shape[0]))
        if x.shape[1] % 256:
            continue
        out[t.name] = x[:1024]  # the first 1024 rows are plenty for an RMSE
        if len(out) >= limit:
            break
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--refusion", default="target/release/refusion")
    ap.add_argument("--gguf", help="an f32/f16/bf16 GGUF to take tensors from")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--types", default="q2_K,q3_K,q4_K,q5_K,q6_K,q4_0,q8_0")
    args = ap.parse_args()
    lib = load_ggml()
    tensors = from_gguf(args.gguf, args.tensors) if args.gguf else synthetic()
    types = args.types.split(",")

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src.gguf")
        w = gguf.GGUFWriter(src, "qwen3")
        w.add_block_count(1)
        w.add_head_count(1)
        w.add_head_count_kv(1)
        for name, x in tensors.items():
            w.add_tensor(name, x)
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

        print(f"{'tensor':<34} {'type':<5} {'refusion rmse':>14} {'llama.cpp rmse':>15} {'ratio':>7} {'bytes equal':>11}")
        totals = {}
        for ty in types:
            out = os.path.join(tmp, f"{ty}.gguf")
            subprocess.run([args.refusion, "quantize", src, out, FTYPE_FOR[ty], "--pure", "-q"], check=True)
            ours = {t.name: t for t in gguf.GGUFReader(out).tensors}
            for name, x in tensors.items():
                t = ours[name]
                assert t.tensor_type == GGML_TYPE[ty], (name, t.tensor_type)
                mine = np.asarray(t.data).reshape(x.shape[0], -1)
                ref = llama_quantize(lib, x, GGML_TYPE[ty])
                e_ours = np.sqrt(np.mean((dequantize(mine, GGML_TYPE[ty]).reshape(x.shape) - x) ** 2))
                e_ref = np.sqrt(np.mean((dequantize(ref, GGML_TYPE[ty]).reshape(x.shape) - x) ** 2))
                same = np.array_equal(mine, ref)
                s = totals.setdefault(ty, [0.0, 0.0, 0])
                s[0] += e_ours ** 2; s[1] += e_ref ** 2; s[2] += 1
                print(f"{name[:34]:<34} {ty:<5} {e_ours:>14.6e} {e_ref:>15.6e} {e_ours / e_ref:>7.4f} {str(same):>11}")
        print()
        print(f"{'type':<5} {'refusion rmse':>14} {'llama.cpp rmse':>15} {'ratio':>7}   (over all tensors)")
        for ty, (a, b, n) in totals.items():
            print(f"{ty:<5} {np.sqrt(a / n):>14.6e} {np.sqrt(b / n):>15.6e} {np.sqrt(a / b):>7.4f}")


if __name__ == "__main__":
    sys.exit(main())
