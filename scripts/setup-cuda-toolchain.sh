#!/usr/bin/env bash
# Installs a CUDA 13.0 toolchain from NVIDIA's PyPI wheels — enough to compile and link
# `cargo build --features cuda` on a machine with no GPU and no NVIDIA driver — and writes an
# env file to source before building.
#
#   bash scripts/setup-cuda-toolchain.sh [DIR] [check|build]
#   . DIR/env.sh && cargo build --release --features cuda
#
# DIR defaults to $REFUSION_CUDA_DIR or ~/.cache/refusion/cuda-13.0; an existing install is
# reused (CI and local runs pay the ~1.2 GB download once per machine).
#   check: nvcc, NVVM, headers and CCCL: what `cargo check --features cuda` needs (~105 MB)
#   build: + cuBLAS, cuRAND, NVRTC, unversioned .so links and a link-time libcuda stub
#
# libcuda.so.1 belongs to the NVIDIA driver and comes in no wheel. The stub built here has
# every cu* entry point return CUDA_ERROR_STUB_LIBRARY: it lets the binary link, and lets a
# machine without a driver run the cuda build (which then reports "no usable GPU" and, with
# `--device auto`, runs on the CPU). Never ship it: on a GPU machine the driver's libcuda
# must be found first.
set -euo pipefail

dir=${1:-${REFUSION_CUDA_DIR:-$HOME/.cache/refusion/cuda-13.0}}
mode=${2:-build}
case "$mode" in check|build) ;; *) echo "usage: $0 [DIR] [check|build]" >&2; exit 2 ;; esac

python=${PYTHON:-python3}
stamp="$dir/.installed-$mode"
if [ ! -e "$stamp" ] && ! { [ "$mode" = check ] && [ -e "$dir/.installed-build" ]; }; then
    "$python" -m venv "$dir"
    wheels=(
        "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*"
        "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*"
    )
    if [ "$mode" = build ]; then
        wheels+=("nvidia-cublas==13.0.*" "nvidia-curand==10.4.0.*" "nvidia-cuda-nvrtc==13.0.*")
    fi
    "$dir/bin/pip" install --quiet --disable-pip-version-check "${wheels[@]}"
    touch "$stamp"
fi

cu=$("$dir/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
[ -x "$cu/bin/nvcc" ] || { echo "error: nvcc not found under $cu" >&2; exit 1; }

if [ "$mode" = build ]; then
    # The linker asks for -lcudart -lcublas -lcublasLt -lcurand -lnvrtc: unversioned names.
    for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
        [ -e "$cu/lib/$lib" ] && ln -sf "$lib" "$cu/lib/${lib%.so.*}.so"
    done
    stubs="$cu/lib/stubs"
    if [ ! -e "$stubs/libcuda.so.1" ]; then
        mkdir -p "$stubs"
        # Every CUresult-returning function declared in cuda.h, as a stub returning error 34.
        {
            echo 'typedef int CUresult;'
            echo 'CUresult cuGetErrorName(int e, const char **s) { if (s) *s = "CUDA_ERROR_STUB_LIBRARY"; return 0; }'
            echo 'CUresult cuGetErrorString(int e, const char **s) { if (s) *s = "no NVIDIA driver on this machine (libcuda.so.1 is a stub)"; return 0; }'
            gcc -E -P -I"$cu/include" "$cu/include/cuda.h" | tr '\n' ' ' \
                | grep -oE 'CUresult +cu[A-Za-z0-9_]+ *\(' | sed -E 's/CUresult +//; s/ *\(//' \
                | sort -u | grep -vx 'cuGetErrorName\|cuGetErrorString' \
                | sed 's/.*/CUresult &(void) { return 34; }/'
        } > "$stubs/libcuda_stub.c"
        gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so.1" "$stubs/libcuda_stub.c"
        ln -sf libcuda.so.1 "$stubs/libcuda.so"
    fi
fi

cat > "$dir/env.sh" <<EOF
# Source this before \`cargo build --features cuda\` (written by scripts/setup-cuda-toolchain.sh).
export CUDA_HOME="$cu"
export CUDA_PATH="$cu"
export PATH="$cu/bin:\$PATH"
export LIBRARY_PATH="$cu/lib:$cu/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
# The GPU family the kernels are built for: 75 Turing, 80 A100, 86 RTX 30xx, 89 RTX 40xx,
# 90 H100/H200, 120 RTX 50xx. Set it before sourcing to pick another.
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-86}"
# To run the cuda build here without a driver (it falls back to the CPU with --device auto):
#   LD_LIBRARY_PATH="$cu/lib:$cu/lib/stubs" target/release/refusion ...
export REFUSION_CUDA_LIBS="$cu/lib"
export REFUSION_CUDA_STUBS="$cu/lib/stubs"
EOF
echo "$dir/env.sh"
