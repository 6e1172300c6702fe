#!/usr/bin/env bash
# The GPU proof in one prepared run, side by side with llama.cpp's own CUDA build, and one table:
#   1. the golden cases at f32 on the GPU (public: all layers and one layer in small chunks;
#      the trained tiny model's: all layers), exact tokens;
#   2. forward throughput of an 8B-shaped Q4_K_M file (`convert --synthetic 8b --grow-from
#      models/refusion-tiny`: the trained tiny model grown to the 8B shape): refusion
#      `bench` against `llama-bench` (-fa 0 and 1, the faster) at 1/16/32/64/512 new tokens over
#      a 256-entry cache, every layer on the GPU and half of them (-ngl 18), with the peak VRAM
#      each used;
#   3. ReFusion's real decode on that file (`bench --decode card,gsm8k`: 8 of the grown model's
#      held-out questions, committed tokens/s, TPF, accuracy) against `llama-bench -n 128`
#      (llama.cpp's autoregressive decode), and the break-even TPF from the measured costs;
#   4. the device: GPU, driver, CUDA, and the libraries each binary resolved to.
#
# usage: scripts/gpu-check.sh               check, with binaries built ahead (or build them)
#        scripts/gpu-check.sh --build-only  here, no GPU: build refusion, the goldens test and
#                                           llama.cpp's llama-bench with CUDA for the GPU family
#                                           in CUDA_COMPUTE_CAP (default 90: H100/H200), strip
#                                           and xz them into $OUT/bin (to carry: under 64 MiB),
#                                           and list the libraries they need
# Environment: OUT (default target/gpu-check), CUDA_COMPUTE_CAP, SHAPE (default 8b),
#   STEP_TIMEOUT (seconds per step, default 240), LLAMA_SDIST (llama-cpp-python's sdist, whose
#   vendored llama.cpp is built; default: ~/.cache/llama-bench/llama_cpp_python-0.3.36.tar.gz,
#   else `pip download`), DEVICE=cpu to rehearse every step on the CPU (with LLAMA_BENCH=a CPU
#   llama-bench, SHAPE=0.6b for a short run).
# The GPU machine needs the NVIDIA driver (580+) and the CUDA 13 runtime libraries (cudart,
# cuBLAS, cuBLASLt, cuRAND): the script names any that are missing before the timed part.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${OUT:-$repo/target/gpu-check}
mkdir -p "$out/bin"
step_timeout=${STEP_TIMEOUT:-240}
sizes=1,16,32,64,512
results=()
failed=0
add() { results+=("$1|$2|$3|$4|$5"); }

cuda_toolchain() {
    if command -v nvcc >/dev/null 2>&1; then return 0; fi
    if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
        export PATH="$CUDA_HOME/bin:$PATH"
        return 0
    fi
    local env_file
    env_file=$(bash scripts/setup-cuda-toolchain.sh "${REFUSION_CUDA_DIR:-$repo/target/cuda-toolchain}" build) \
        || { echo "no CUDA toolchain and none could be installed" >&2; return 1; }
    # shellcheck disable=SC1090
    . "$env_file"
}

build_refusion() {
    echo "building refusion for compute capability $CUDA_COMPUTE_CAP ..." >&2
    # cudaforge (candle's kernel build) runs nvcc on half the cores unless told.
    export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
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
}

# llama.cpp's own llama-bench with CUDA, from the llama.cpp that llama-cpp-python's sdist vendors
# (the same llama.cpp as every CPU comparison in benches/README.md), statically linked to ggml.
build_llama_bench() {
    local sdist=${LLAMA_SDIST:-$HOME/.cache/llama-bench/llama_cpp_python-0.3.36.tar.gz}
    local src=$repo/target/llama-cuda/src build=$repo/target/llama-cuda/build-sm$CUDA_COMPUTE_CAP
    if [ ! -s "$sdist" ]; then
        # The sdist itself from PyPI's simple index (`pip download --no-binary :all:` would
        # build its build tools, cmake included, from source just to read its metadata).
        mkdir -p "$repo/target/llama-cuda"
        sdist=$repo/target/llama-cuda/llama_cpp_python-0.3.36.tar.gz
        local url
        url=$(curl -fsS https://pypi.org/simple/llama-cpp-python/ \
            | grep -o 'href="[^"]*llama_cpp_python-0.3.36.tar.gz[^"]*"' | head -1 | cut -d'"' -f2)
        [ -n "$url" ] && curl -fsSL -o "$sdist" "$url" || { echo "cannot download llama-cpp-python 0.3.36's sdist" >&2; return 1; }
    fi
    if [ ! -d "$src" ]; then
        mkdir -p "$src" && tar xzf "$sdist" -C "$src" --strip-components=3 \
            llama_cpp_python-0.3.36/vendor/llama.cpp || return 1
    fi
    echo "building llama-bench (CUDA, sm_$CUDA_COMPUTE_CAP) ..." >&2
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DBUILD_SHARED_LIBS=OFF \
        -DCMAKE_CUDA_ARCHITECTURES="$CUDA_COMPUTE_CAP" -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" \
        -DCUDAToolkit_ROOT="${CUDA_HOME:-}" -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >&2 || return 1
    cmake --build "$build" --target llama-bench -j "$(nproc)" >&2 || return 1
    cp "$build/bin/llama-bench" "$out/bin/llama-bench" && strip "$out/bin/llama-bench"
}

# Binaries carried from another machine come xz-compressed.
unpack() {
    for b in refusion goldens llama-bench; do
        if [ -s "$out/bin/$b.xz" ] && { [ ! -x "$out/bin/$b" ] || [ "$out/bin/$b.xz" -nt "$out/bin/$b" ]; }; then
            xz -dc "$out/bin/$b.xz" > "$out/bin/$b" && chmod +x "$out/bin/$b"
        fi
    done
}

# "name: lib => path" for every library a binary resolves, and the missing ones.
libraries() {
    ldd "$1" 2>/dev/null | awk -v n="$(basename "$1")" '/=>/ {print n ": " $1 " => " $3}'
}

if [ "${1:-}" = --build-only ]; then
    export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
    cuda_toolchain || exit 1
    t=$(date +%s)
    build_refusion || exit 1
    echo "refusion built in $(( $(date +%s) - t )) s" >&2
    t=$(date +%s)
    build_llama_bench || { echo "llama-bench (CUDA) failed to build" >&2; exit 1; }
    echo "llama-bench built in $(( $(date +%s) - t )) s" >&2
    for b in refusion goldens llama-bench; do xz -T0 -6 -kf "$out/bin/$b"; done
    echo "$CUDA_COMPUTE_CAP" > "$out/bin/compute-cap"
    echo "libraries the binaries need (the driver's libcuda and the CUDA 13 runtime on the GPU machine):"
    for b in refusion llama-bench; do libraries "$out/bin/$b" | grep -v '/lib/x86_64-linux-gnu\|linux-vdso\|ld-linux'; done
    du -ch "$out"/bin/*.xz "$out/bin/compute-cap" | tail -1
    echo "carry target/gpu-check/bin (the .xz files and compute-cap) for sm_$CUDA_COMPUTE_CAP"
    exit 0
fi

device=${DEVICE:-cuda}
shape=${SHAPE:-8b}
t0=$(date +%s)
vram() { echo 0; }
if [ "$device" = cpu ]; then
    gpu="none (rehearsal on the CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
    cargo build --release --locked --bin refusion >&2 || exit 1
    test_bin=$(cargo test --release --locked --test goldens --no-run --message-format=json 2>/dev/null \
        | grep -o '"executable":"[^"]*goldens[^"]*"' | tail -1 | cut -d'"' -f4)
    cp target/release/refusion "$out/bin/refusion-cpu"
    cp "$test_bin" "$out/bin/goldens-cpu"
    bin=$out/bin/refusion-cpu
    goldens=$out/bin/goldens-cpu
    llama=${LLAMA_BENCH:-$HOME/.cache/llama-bench/build-native/bin/llama-bench}
    versions="CPU only"
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
        { cuda_toolchain && build_refusion; } || { echo "gpu-check: build failed" >&2; exit 1; }
    fi
    bin=$out/bin/refusion
    goldens=$out/bin/goldens
    llama=${LLAMA_BENCH:-$out/bin/llama-bench}
    # Before anything is timed: every library both binaries need must resolve.
    missing=$(for b in "$bin" "$llama"; do ldd "$b" 2>/dev/null | awk '/not found/ {print $1}'; done | sort -u | tr '\n' ' ')
    if [ -n "$missing" ]; then
        echo "gpu-check: missing libraries: $missing(install the NVIDIA driver and the CUDA 13" \
            "runtime, or put the lib folders of the nvidia-cuda-runtime, nvidia-cublas and" \
            "nvidia-curand wheels on LD_LIBRARY_PATH)" >&2
        exit 1
    fi
    cuda=$(nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | head -1)
    versions="driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1), $cuda; $(libraries "$bin" | grep -E 'libcu|libnvrtc' | sed 's/.*=> //' | xargs -n1 basename 2>/dev/null | sort -u | tr '\n' ' ')"
    # Peak VRAM used while a command runs, sampled every 100 ms, above what was used before.
    vram() {
        local base peak
        base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
        ( while :; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; sleep 0.1; done ) >"$out/vram.samples" &
        local sampler=$!
        "$@"
        local rc=$?
        kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
        peak=$(sort -n "$out/vram.samples" | tail -1)
        echo $(( ${peak:-$base} - base )) >"$out/vram.last"
        return $rc
    }
fi
[ -x "$llama" ] || { echo "gpu-check: no llama-bench at $llama (build it with --build-only)" >&2; exit 1; }
run_measured() { if [ "$device" = cpu ]; then "$@"; else vram "$@"; fi; }
mib() { if [ "$device" = cpu ]; then echo "-"; else echo "$(cat "$out/vram.last") MiB"; fi; }
add build "$device${CUDA_COMPUTE_CAP:+, sm_$CUDA_COMPUTE_CAP}" "$(( $(date +%s) - t0 )) s" "" ""

# 1. Parity goldens at f32 on the device.
t=$(date +%s)
log=$out/goldens.log
if REFUSION_TEST_DEVICE=$device REFUSION_BIN=$bin REFUSION_REPO=$repo \
    timeout "$step_timeout" "$goldens" offloaded --test-threads 1 >"$log" 2>&1 \
    && grep -q 'test result: ok. 4 passed' "$log"; then
    add "goldens f32, $device" "111 public cases x 2 offload layouts, again with every plan split (host and device) + 72 trained-model cases" "exact ($(( $(date +%s) - t )) s)" "" ""
else
    failed=1
    add "goldens f32, $device" "offloaded" "FAILED: $(grep -m1 -E 'cases differ|panicked|test result' "$log")" "" ""
fi

# 2. Forward throughput, Q4_K_M, all layers and half of them.
model=$out/grown-$shape-q4_k_m.gguf
if [ ! -s "$model" ]; then
    timeout "$step_timeout" "$bin" convert --synthetic "$shape" --grow-from "$repo/models/refusion-tiny" \
        --outtype q4_k_m -o "$model" -q || { failed=1; add "$shape file" "" "FAILED to write" "" ""; }
fi
layers=$("$bin" info "$model" 2>/dev/null | grep -o 'block_count[^0-9]*[0-9]*' | grep -o '[0-9]*$')
half=$(( ${layers:-36} / 2 ))
# llama-bench's best of -fa 0/1 for a test in its jsonl output.
llama_best() {
    # $1: jsonl file, $2: n_prompt, $3: n_gen; prints "t/s fa"
    python3 - "$@" <<'EOF'
import json, sys
best = None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["n_prompt"] == int(sys.argv[2]) and r["n_gen"] == int(sys.argv[3]):
        if best is None or r["avg_ts"] > best[0]:
            best = (r["avg_ts"], r["flash_attn"])
print(f"{best[0]:.2f} {str(best[1]).lower()}" if best else "0 -")
EOF
}
ours_tps() {
    python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(next(("%.2f" % r["tokens_per_s"] for r in rows if r["n_tokens"] == int(sys.argv[2])), ""))' "$1" "$2"
}
if [ -s "$model" ]; then
    for ngl in all "$half"; do
        lngl=$([ "$ngl" = all ] && echo 99 || echo "$ngl")
        if run_measured timeout "$step_timeout" "$bin" bench -m "$model" --device "$device" -ngl "$ngl" \
            -p "$sizes" -d 256 -c 1024 -r 5 --json >"$out/bench-$ngl.jsonl" 2>"$out/bench-$ngl.log"; then
            ours_vram=$(mib)
        else
            failed=1; ours_vram="FAILED: $(tail -1 "$out/bench-$ngl.log")"
        fi
        if run_measured timeout "$step_timeout" "$llama" -m "$model" -ngl "$lngl" -p "$sizes" -n 0 -d 256 \
            -fa 0,1 -r 5 -o jsonl >"$out/llama-$ngl.jsonl" 2>"$out/llama-$ngl.log"; then
            llama_vram=$(mib)
        else
            failed=1; llama_vram="FAILED: $(tail -1 "$out/llama-$ngl.log")"
        fi
        for n in ${sizes//,/ }; do
            o=$(ours_tps "$out/bench-$ngl.jsonl" "$n")
            read -r l fa <<<"$(llama_best "$out/llama-$ngl.jsonl" "$n" 0)"
            ratio=$(awk -v a="${o:-0}" -v b="${l:-0}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')
            add "forward $shape Q4_K_M, -ngl $ngl" "pp$n @ d256" "${o:-FAILED} ($ours_vram)" "$l (fa $fa; $llama_vram)" "$ratio"
        done
    done

    # 3. ReFusion's decode of the grown model's held-out questions against llama.cpp's
    # autoregressive decode of the same file.
    if run_measured timeout "$step_timeout" "$bin" bench -m "$model" --device "$device" -ngl all \
        --decode card,gsm8k --prompts 8 -o jsonl >"$out/decode.jsonl" 2>"$out/decode.log"; then
        dec_vram=$(mib)
    else
        failed=1; dec_vram="FAILED: $(tail -1 "$out/decode.log")"
        add "decode $shape Q4_K_M (grown, trained), -ngl all" "card, gsm8k" "$dec_vram" "" ""
    fi
    run_measured timeout "$step_timeout" "$llama" -m "$model" -ngl 99 -p 0 -n 128 -fa 0,1 -r 3 -o jsonl \
        >"$out/llama-tg.jsonl" 2>"$out/llama-tg.log" || failed=1
    llama_tg_vram=$(mib)
    read -r ltg lfa <<<"$(llama_best "$out/llama-tg.jsonl" 0 128)"
    ms_fwd=0
    while read -r test tps tpf acc ms; do
        [ -n "$test" ] || continue
        ms_fwd=$ms
        ratio=$(awk -v a="$tps" -v b="$ltg" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')
        add "decode $shape Q4_K_M (grown, trained), -ngl all" "$test, 8 questions" \
            "$tps t/s, TPF $tpf, acc $acc ($dec_vram)" "$ltg tg128 (fa $lfa; $llama_tg_vram)" "$ratio"
    done <<<"$(python3 -c '
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    ms = 1000 * r["seconds"] / max(r["forwards"], 1)
    print(r["test"].split()[1], "%.1f" % r["tokens_per_s"], "%.2f" % r["tpf"], "%.0f%%" % (100 * (r["accuracy"] or 0)), "%.1f" % ms)' "$out/decode.jsonl" 2>/dev/null)"
    even=$(awk -v m="$ms_fwd" -v l="$ltg" 'BEGIN { printf "%.2f", m * l / 1000 }')
    add "break-even TPF" "ms per forward (gsm8k) x llama.cpp t/s" "$even" "" ""
fi
# The trained tiny model on the device: a real TPF at the card's settings.
tiny=$out/refusion-tiny-q4_k_m.gguf
if timeout "$step_timeout" "$bin" convert "$repo/models/refusion-tiny" -o "$tiny" --outtype q4_k_m -q \
    && timeout "$step_timeout" "$bin" generate -m "$tiny" --device "$device" -ngl all -p "What is 47 + 38?" \
        --json >"$out/tiny.json" 2>"$out/tiny.log"; then
    add "decode tiny Q4_K_M (trained), -ngl all" "model card settings" \
        "$(python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); print("TPF %.2f, %.0f t/s, %s" % (j["tpf"], j["timings"]["tokens_per_s"], j["text"].splitlines()[-1]))' "$out/tiny.json")" "" ""
else
    failed=1; add "decode tiny Q4_K_M" "" "FAILED: $(tail -1 "$out/tiny.log")" "" ""
fi

echo
echo "GPU: $gpu; $versions; CPU: $(nproc) cores; total $(( $(date +%s) - t0 )) s"
echo "| check | setting | refusion | llama.cpp (best of -fa 0/1) | ratio |"
echo "| --- | --- | --- | --- | --- |"
for r in "${results[@]}"; do
    IFS='|' read -r a b c d e <<<"$r"
    echo "| $a | $b | $c | $d | $e |"
done
exit $failed
