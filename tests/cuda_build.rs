//! The CUDA build on a machine without a GPU (CI): it links, starts, says in one line that
//! there is no usable GPU, runs on the CPU with `--device auto` (exactly the CPU build's
//! tokens) and refuses `--device cuda` cleanly. `.ci/run` builds it and points
//! `REFUSION_CUDA_BIN` at it, with the toolchain's runtime libraries and libcuda stub on
//! `LD_LIBRARY_PATH`; without that variable there is no CUDA build to check.

mod common;

use std::process::Command;

use common::*;

fn cuda_bin() -> Option<std::path::PathBuf> {
    match std::env::var_os("REFUSION_CUDA_BIN") {
        Some(p) => Some(p.into()),
        None => {
            eprintln!("REFUSION_CUDA_BIN is not set: no CUDA build to check (.ci/run sets it)");
            None
        }
    }
}

#[test]
fn the_cuda_build_falls_back_to_the_cpu_in_one_line() {
    let Some(cuda) = cuda_bin() else { return };
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("a.gguf");
    convert_quiet(&fixture_model("pub-a"), &gguf, "q8_0");
    let args = [
        "generate",
        "-m",
        gguf.to_str().unwrap(),
        "--prompt-ids",
        "5,6,7",
        "-n",
        "16",
        "-t",
        "2",
    ];
    let cpu = run(&args);
    assert!(cpu.status.success(), "{}", stderr(&cpu));

    let auto = Command::new(&cuda)
        .args(args)
        .args(["--device", "auto"])
        .output()
        .unwrap();
    let err = stderr(&auto);
    assert!(auto.status.success(), "{err}");
    let notes: Vec<&str> = err.lines().filter(|l| l.contains("GPU")).collect();
    assert_eq!(notes.len(), 1, "one line about the GPU:\n{err}");
    assert!(
        notes[0].starts_with("no usable GPU") && notes[0].ends_with("running on the CPU"),
        "{err}"
    );
    assert_eq!(
        stdout(&auto),
        stdout(&cpu),
        "the same tokens as the CPU build"
    );

    let forced = Command::new(&cuda)
        .args(args)
        .args(["--device", "cuda", "-ngl", "all"])
        .output()
        .unwrap();
    assert_fails_with(&forced, &["cannot open CUDA device 0"]);
    let err = stderr(&forced);
    assert_eq!(err.trim().lines().count(), 1, "one line:\n{err}");
}
