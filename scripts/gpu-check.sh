#!/usr/bin/env bash
# Proves the CUDA path on a GPU machine in one short run (about 10 minutes on 16 cores with the
# build; a few minutes with binaries built ahead) and prints one table:
#   1. the parity goldens at f32 on the GPU: every public golden case, exact tokens, with all
#      layers (and the output layer) offloaded and with one layer offloaded in small chunks;
#   2. forward throughput of a Qwen3-8B-shaped Q4_K_M file (random weights) with every layer
#      on the GPU, at 1/16/32/64/512 new tokens over a 256-entry cache (llama-bench's pp@d256);
#   3. a ReFusion decode of 128 tokens from that file at a few -ngl values.
#
# usage: scripts/gpu-check.sh               build (if needed) and check
#        scripts/gpu-check.sh --build-only  build the binaries into $OUT/bin for the GPU family
#                                           in CUDA_COMPUTE_CAP (on any machine with the
#                                           toolchain: scripts/setup-cuda-toolchain.sh), to
#                                           carry to the GPU machine
# The GPU machine needs the NVIDIA driver (580+) and the CUDA 13 runtime libraries (cudart,
# cuBLAS, cuRAND); the script says which are missing.
# Environment: OUT (default target/gpu-check), CUDA_COMPUTE_CAP (default: the GPU's),
#              NGL_VALUES (default "0 12 24 all"), STEP_TIMEOUT (seconds per step, default 300),
#              SHAPE (default 8b), DEVICE=cpu to rehearse the script without a GPU (with
#              SHAPE=0.6b: the same steps on the CPU build in target/release).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${OUT:-$repo/target/gpu-check}
mkdir -p "$out/bin"
step_timeout=${STEP_TIMEOUT:-300}
results=()
failed=0
add() { results+=("$1|$2|$3"); }

build() {
    if ! command -v nvcc >/dev/null 2>&1; then
        if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
            export PATH="$CUDA_HOME/bin:$PATH"
        else
            env_file=$(bash scripts/setup-cuda-toolchain.sh) || { echo "no CUDA toolchain and none could be installed" >&2; return 1; }
            # shellcheck disable=SC1090
            . "$env_file"
        fi
    fi
    echo "building for compute capability ${CUDA_COMPUTE_CAP:?set CUDA_COMPUTE_CAP} ..." >&2
    cargo build --release --locked --features cuda --bin refusion --target-dir target/cuda >&2 || return 1
    # The goldens test binary, built ahead like the main one (it finds the binary and the
    # fixtures through REFUSION_BIN and REFUSION_REPO at run time).
    local test_bin
    test_bin=$(cargo test --release --locked --features cuda --test goldens --no-run --target-dir target/cuda --message-format=json 2>/dev/null \
        | grep -o '"executable":"[^"]*goldens[^"]*"' | tail -1 | cut -d'"' -f4)
    [ -x "$test_bin" ] || { echo "could not build the goldens test binary" >&2; return 1; }
    cp target/cuda/release/refusion "$out/bin/refusion"
    cp "$test_bin" "$out/bin/goldens"
    strip "$out/bin/refusion" "$out/bin/goldens" 2>/dev/null || true
    echo "$CUDA_COMPUTE_CAP" > "$out/bin/compute-cap"
}

# Binaries carried from another machine come xz-compressed (about 7 MB each instead of 57).
unpack() {
    for b in refusion goldens; do
        if [ ! -x "$out/bin/$b" ] && [ -s "$out/bin/$b.xz" ]; then
            xz -dc "$out/bin/$b.xz" > "$out/bin/$b" && chmod +x "$out/bin/$b"
        fi
    done
}

if [ "${1:-}" = --build-only ]; then
    build || exit 1
    for b in refusion goldens; do xz -T0 -6 -kf "$out/bin/$b"; done
    echo "binaries for sm_$CUDA_COMPUTE_CAP in $out/bin (carry $out/bin/*.xz and compute-cap)"
    exit 0
fi

device=${DEVICE:-cuda}
shape=${SHAPE:-8b}
t0=$(date +%s)
if [ "$device" = cpu ]; then
    gpu="none (rehearsal on the CPU)"
    cargo build --release --locked --bin refusion >&2 || exit 1
    test_bin=$(cargo test --release --locked --test goldens --no-run --message-format=json 2>/dev/null \
        | grep -o '"executable":"[^"]*goldens[^"]*"' | tail -1 | cut -d'"' -f4)
    cp target/release/refusion "$out/bin/refusion-cpu"
    cp "$test_bin" "$out/bin/goldens-cpu"
    bin=$out/bin/refusion-cpu
    goldens=$out/bin/goldens-cpu
else
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu-check: no NVIDIA GPU here (nvidia-smi finds none); nothing to check" >&2
        exit 2
    fi
    gpu=$(nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader | head -1)
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
    export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-$cap}
    echo "GPU: $gpu; CPU: $(nproc) cores" >&2
    unpack
    if [ ! -x "$out/bin/refusion" ] || [ "$(cat "$out/bin/compute-cap" 2>/dev/null)" != "$CUDA_COMPUTE_CAP" ]; then
        build || { echo "gpu-check: build failed" >&2; exit 1; }
    fi
    bin=$out/bin/refusion
    goldens=$out/bin/goldens
    # The cuda build links the driver's libcuda and the CUDA 13 runtime libraries.
    missing=$(ldd "$bin" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ')
    if [ -n "$missing" ]; then
        echo "gpu-check: missing libraries: $missing(install the CUDA 13 runtime, or put the lib" \
            "folders of the nvidia-cuda-runtime, nvidia-cublas and nvidia-curand wheels on LD_LIBRARY_PATH)" >&2
        exit 1
    fi
fi
add build "$device${CUDA_COMPUTE_CAP:+, sm_$CUDA_COMPUTE_CAP}" "$(( $(date +%s) - t0 )) s"

# 1. Parity goldens at f32 on the GPU.
t=$(date +%s)
log=$out/goldens.log
if REFUSION_TEST_DEVICE=$device REFUSION_BIN=$bin REFUSION_REPO=$repo \
    timeout "$step_timeout" "$goldens" offloaded --test-threads 1 >"$log" 2>&1 \
    && grep -q 'test result: ok. 3 passed' "$log"; then
    add "goldens f32, $device" "111 public cases x 2 offload layouts, the trained tiny model's" "exact ($(( $(date +%s) - t )) s)"
else
    failed=1
    add "goldens f32, $device" "111 public cases x 2 offload layouts, the trained tiny model's" "FAILED: $(grep -m1 -E 'cases differ|panicked|test result' "$log")"
fi

# 2. Forward throughput, Q4_K_M, every layer on the GPU.
model=$out/qwen3-$shape-q4_k_m.gguf
if [ ! -s "$model" ]; then
    timeout "$step_timeout" "$bin" convert --synthetic "$shape" --outtype q4_k_m -o "$model" -q \
        --tokenizer-dir "$repo/tests/fixtures/tokenizers/refusion" || { failed=1; add "$shape file" "" "FAILED to write"; }
fi
if [ -s "$model" ]; then
    if timeout "$step_timeout" "$bin" bench -m "$model" --device "$device" -ngl all -p 1,16,32,64,512 -r 5 \
        --json >"$out/bench.jsonl" 2>"$out/bench.log"; then
        while read -r line; do
            n=$(sed -E 's/.*"n_tokens":([0-9]+).*/\1/' <<<"$line")
            tps=$(sed -E 's/.*"tokens_per_s":([0-9.e+-]+).*/\1/' <<<"$line")
            add "forward $shape Q4_K_M, -ngl all" "pp$n @ d256" "$(printf '%.1f' "$tps") t/s"
        done <"$out/bench.jsonl"
    else
        failed=1
        add "forward $shape Q4_K_M, -ngl all" "" "FAILED: $(tail -1 "$out/bench.log")"
    fi

    # 3. ReFusion decode at a few -ngl values (random weights: the TPF is not the real model's).
    for ngl in ${NGL_VALUES:-0 12 24 all}; do
        if timeout "$step_timeout" "$bin" generate -m "$model" --device "$device" -ngl "$ngl" -n 128 \
            -p "Write a short story about a lighthouse." --json >"$out/decode-$ngl.json" 2>"$out/decode-$ngl.log"; then
            j=$(cat "$out/decode-$ngl.json")
            tps=$(sed -E 's/.*"tokens_per_s":([0-9.e+-]+).*/\1/' <<<"$j")
            tpf=$(sed -E 's/.*"tpf":([0-9.e+-]+).*/\1/' <<<"$j")
            plan=$(grep -m1 'memory plan' "$out/decode-$ngl.log" | sed 's/memory plan: //')
            add "decode $shape Q4_K_M, 128 tokens" "-ngl $ngl ($plan)" "$(printf '%.1f' "$tps") t/s, TPF $tpf"
        else
            failed=1
            add "decode $shape Q4_K_M, 128 tokens" "-ngl $ngl" "FAILED: $(tail -1 "$out/decode-$ngl.log")"
        fi
    done
fi

echo
echo "GPU: $gpu; CPU: $(nproc) cores; total $(( $(date +%s) - t0 )) s"
echo "| check | setting | result |"
echo "| --- | --- | --- |"
for r in "${results[@]}"; do
    IFS='|' read -r a b c <<<"$r"
    echo "| $a | $b | $c |"
done
exit $failed
