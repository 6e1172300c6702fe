//! Hostile model files through the binary: a real GGUF truncated at many offsets and with
//! seeded byte flips, hand-made headers with every structural lie (offsets past the end, huge
//! counts, overlaps, misalignment, duplicate keys, unknown types), and paths that are not files
//! (a FIFO, a directory, /dev/zero). `info` and `generate` must answer each with success or one
//! clean error line: no panic, no hang, no crash. Run with `--nocapture` for the counts.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;

#[derive(Default, Debug)]
struct Tally {
    tried: usize,
    clean_error: usize,
    accepted: usize,
    panic: Vec<String>,
    hang: Vec<String>,
    unclear: Vec<String>,
}

/// Runs refusion with `args`, within 30 s, and files the outcome.
fn classify(args: &[String], tally: &Mutex<Tally>) {
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let err = reader.join().unwrap();
    let mut t = tally.lock().unwrap();
    t.tried += 1;
    let what = format!("{args:?}\n{err}");
    let Some(status) = status else {
        t.hang.push(what);
        return;
    };
    if err.contains("panicked") || status.code() == Some(101) {
        t.panic.push(what);
    } else if status.success() {
        t.accepted += 1;
    } else if status.code() == Some(1)
        && err.lines().filter(|l| l.starts_with("error")).count() == 1
    {
        t.clean_error += 1;
    } else {
        t.unclear.push(format!("exit {status:?}: {what}"));
    }
}

/// `info FILE` and `generate -m FILE` on every file, two at a time.
fn run_all(files: &[PathBuf], tally: &Mutex<Tally>) {
    let jobs: Vec<Vec<String>> = files
        .iter()
        .flat_map(|f| {
            let f = f.to_str().unwrap().to_string();
            [
                vec!["info".to_string(), f.clone()],
                [
                    "generate",
                    "-m",
                    &f,
                    "--prompt-ids",
                    "1,2",
                    "-n",
                    "4",
                    "-c",
                    "64",
                ]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ]
        })
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(args) = jobs.get(i) else { return };
                classify(args, tally);
            });
        }
    });
}

fn assert_clean(name: &str, tally: Mutex<Tally>) {
    let t = tally.into_inner().unwrap();
    eprintln!(
        "{name}: {} tried, {} clean errors, {} accepted, {} panics, {} hangs, {} unclear",
        t.tried,
        t.clean_error,
        t.accepted,
        t.panic.len(),
        t.hang.len(),
        t.unclear.len()
    );
    assert!(t.panic.is_empty(), "panics:\n{}", t.panic.join("\n"));
    assert!(t.hang.is_empty(), "hangs:\n{}", t.hang.join("\n"));
    assert!(t.unclear.is_empty(), "unclear:\n{}", t.unclear.join("\n"));
}

/// A little generator for seeded choices.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn real_file(dir: &Path, outtype: &str) -> (PathBuf, Vec<u8>) {
    let p = dir.join(format!("a-{outtype}.gguf"));
    convert_quiet(&fixture_model("pub-a"), &p, outtype);
    let bytes = std::fs::read(&p).unwrap();
    (p, bytes)
}

/// Where the tensor data begins: after the header, aligned (read back with the crate).
fn data_offset(path: &Path) -> usize {
    refusion_gguf::GgufFile::open(path)
        .unwrap()
        .header
        .data_offset as usize
}

#[test]
fn a_gguf_truncated_anywhere_is_refused_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for outtype in ["f32", "q8_0"] {
        let (path, bytes) = real_file(tmp.path(), outtype);
        let header = data_offset(&path);
        // Every byte of the fixed part, then across the header, then into the data.
        let mut cuts: Vec<usize> = (0..48).collect();
        cuts.extend((48..header).step_by(header / 60 + 1));
        cuts.extend([header - 1, header, header + 1]);
        cuts.extend((header..bytes.len()).step_by((bytes.len() - header) / 12 + 1));
        cuts.push(bytes.len() - 1);
        for cut in cuts {
            let p = tmp.path().join(format!("cut-{outtype}-{cut}.gguf"));
            std::fs::write(&p, &bytes[..cut]).unwrap();
            files.push(p);
        }
    }
    let tally = Mutex::new(Tally::default());
    run_all(&files, &tally);
    assert_clean("truncated", tally);
}

#[test]
fn seeded_byte_flips_are_refused_cleanly_or_run() {
    let tmp = tempfile::tempdir().unwrap();
    let (path, bytes) = real_file(tmp.path(), "q8_0");
    let header = data_offset(&path);
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut files = Vec::new();
    for i in 0..160 {
        let mut b = bytes.clone();
        // Most flips land in the header, where they change meaning; some in the data.
        let n_flips = 1 + rng.below(4);
        for _ in 0..n_flips {
            let at = if rng.below(5) == 0 {
                header + rng.below(bytes.len() - header)
            } else {
                rng.below(header)
            };
            b[at] ^= 1 << rng.below(8);
        }
        let p = tmp.path().join(format!("flip-{i}.gguf"));
        std::fs::write(&p, &b).unwrap();
        files.push(p);
    }
    let tally = Mutex::new(Tally::default());
    run_all(&files, &tally);
    assert_clean("byte flips", tally);
}

/// A GGUF written field by field, so that any field can lie.
#[derive(Clone)]
struct Raw {
    version: u32,
    /// Overrides the tensor count written (the list stays as it is).
    n_tensors: Option<u64>,
    n_kv: Option<u64>,
    kvs: Vec<(String, u32, Vec<u8>)>,
    /// name, dims, type id, offset.
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    alignment: usize,
    data: Vec<u8>,
}

fn str_bytes(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(s.as_bytes());
    b
}

impl Raw {
    /// Two small f32 tensors and a plausible qwen3 header.
    fn good() -> Raw {
        let u32v = |v: u32| v.to_le_bytes().to_vec();
        let kvs = vec![
            ("general.architecture".to_string(), 8, str_bytes("qwen3")),
            ("qwen3.block_count".to_string(), 4, u32v(1)),
            ("qwen3.context_length".to_string(), 4, u32v(64)),
            ("qwen3.embedding_length".to_string(), 4, u32v(8)),
            ("qwen3.feed_forward_length".to_string(), 4, u32v(16)),
            ("qwen3.attention.head_count".to_string(), 4, u32v(2)),
            (
                "qwen3.attention.layer_norm_rms_epsilon".to_string(),
                6,
                1e-6f32.to_le_bytes().to_vec(),
            ),
        ];
        Raw {
            version: 3,
            n_tensors: None,
            n_kv: None,
            kvs,
            tensors: vec![
                ("token_embd.weight".into(), vec![8, 16], 0, 0),
                ("output_norm.weight".into(), vec![8], 0, 512),
            ],
            alignment: 32,
            data: vec![0u8; 512 + 32],
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        let nt = self.n_tensors.unwrap_or(self.tensors.len() as u64);
        let nk = self.n_kv.unwrap_or(self.kvs.len() as u64);
        b.extend_from_slice(&nt.to_le_bytes());
        b.extend_from_slice(&nk.to_le_bytes());
        for (k, ty, v) in &self.kvs {
            b.extend_from_slice(&str_bytes(k));
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(v);
        }
        for (name, dims, ty, off) in &self.tensors {
            b.extend_from_slice(&str_bytes(name));
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&off.to_le_bytes());
        }
        while !b.len().is_multiple_of(self.alignment) {
            b.push(0);
        }
        b.extend_from_slice(&self.data);
        b
    }
}

#[test]
fn structural_lies_in_a_header_are_refused_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let u64v = |v: u64| v.to_le_bytes().to_vec();
    let mut cases: Vec<(&str, Raw)> = Vec::new();
    let edit = |f: &dyn Fn(&mut Raw)| {
        let mut r = Raw::good();
        f(&mut r);
        r
    };
    cases.push(("good", Raw::good()));
    cases.push(("version 2", edit(&|r| r.version = 2)));
    cases.push(("version 1", edit(&|r| r.version = 1)));
    cases.push(("version 99", edit(&|r| r.version = 99)));
    cases.push(("offset past the end", edit(&|r| r.tensors[1].3 = 1 << 40)));
    cases.push((
        "offset at u64::MAX",
        edit(&|r| r.tensors[1].3 = u64::MAX - 7),
    ));
    cases.push(("overlapping tensors", edit(&|r| r.tensors[1].3 = 256)));
    cases.push(("misaligned offset", edit(&|r| r.tensors[1].3 = 513)));
    cases.push((
        "duplicate tensor",
        edit(&|r| r.tensors[1].0 = "token_embd.weight".into()),
    ));
    cases.push((
        "duplicate key",
        edit(&|r| {
            let k = r.kvs[1].clone();
            r.kvs.push(k)
        }),
    ));
    cases.push(("huge tensor count", edit(&|r| r.n_tensors = Some(1 << 60))));
    cases.push(("huge key count", edit(&|r| r.n_kv = Some(u64::MAX))));
    cases.push((
        "huge dims",
        edit(&|r| r.tensors[0].1 = vec![u64::MAX, u64::MAX]),
    ));
    cases.push(("a zero dim", edit(&|r| r.tensors[0].1 = vec![8, 0])));
    cases.push(("too many dims", edit(&|r| r.tensors[0].1 = vec![1; 9])));
    cases.push(("unknown tensor type", edit(&|r| r.tensors[0].2 = 77)));
    cases.push(("a type whose size differs", edit(&|r| r.tensors[0].2 = 8)));
    cases.push(("unknown value type", edit(&|r| r.kvs[1].1 = 99)));
    cases.push(("huge string", edit(&|r| r.kvs[0].2 = u64v(u64::MAX))));
    cases.push((
        "huge array",
        edit(&|r| {
            let mut v = 4u32.to_le_bytes().to_vec();
            v.extend_from_slice(&u64v(1 << 62));
            r.kvs.push(("x.arr".into(), 9, v))
        }),
    ));
    cases.push((
        "nested arrays",
        edit(&|r| {
            let mut v = Vec::new();
            for _ in 0..2000 {
                v.extend_from_slice(&9u32.to_le_bytes());
                v.extend_from_slice(&u64v(1));
            }
            r.kvs.push(("x.deep".into(), 9, v))
        }),
    ));
    cases.push((
        "alignment 0",
        edit(&|r| {
            r.kvs
                .push(("general.alignment".into(), 4, 0u32.to_le_bytes().to_vec()))
        }),
    ));
    cases.push((
        "alignment 3",
        edit(&|r| {
            r.kvs
                .push(("general.alignment".into(), 4, 3u32.to_le_bytes().to_vec()))
        }),
    ));
    cases.push((
        "a string key that is not UTF-8",
        edit(&|r| {
            r.kvs.push(("x.bad".into(), 8, {
                let mut v = u64v(2);
                v.extend_from_slice(&[0xff, 0xfe]);
                v
            }))
        }),
    ));
    cases.push((
        "context length u64::MAX",
        edit(&|r| r.kvs[2] = ("qwen3.context_length".into(), 10, u64v(u64::MAX))),
    ));
    cases.push((
        "head count 0",
        edit(&|r| r.kvs[5].2 = 0u32.to_le_bytes().to_vec()),
    ));
    cases.push((
        "eps NaN",
        edit(&|r| r.kvs[6].2 = f32::NAN.to_le_bytes().to_vec()),
    ));
    let mut files = Vec::new();
    for (i, (name, raw)) in cases.iter().enumerate() {
        let p = tmp
            .path()
            .join(format!("s{i}-{}.gguf", name.replace(' ', "_")));
        std::fs::write(&p, raw.bytes()).unwrap();
        files.push(p);
    }
    // Paths that are not files, and an empty file.
    let fifo = tmp.path().join("fifo.gguf");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    files.push(fifo);
    files.push(tmp.path().to_path_buf());
    files.push(PathBuf::from("/dev/zero"));
    let empty = tmp.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    files.push(empty);
    let tally = Mutex::new(Tally::default());
    run_all(&files, &tally);
    assert_clean("structural edits and non-files", tally);
}

/// llama.cpp's --check-tensors: a NaN or Inf weight, or a quantized block whose scale is one,
/// is named; without the flag the file loads as before.
#[test]
fn check_tensors_names_the_tensor_that_holds_nan() {
    let tmp = tempfile::tempdir().unwrap();
    for outtype in ["f32", "q8_0"] {
        let (path, bytes) = real_file(tmp.path(), outtype);
        let f = refusion_gguf::GgufFile::open(&path).unwrap();
        let t = f.header.tensor("blk.1.ffn_up.weight").unwrap();
        let at = (f.header.data_offset + t.offset) as usize;
        let mut b = bytes.clone();
        // The first value of an f32 tensor; the scale of a Q8_0 tensor's first block.
        match outtype {
            "f32" => b[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes()),
            _ => b[at..at + 2].copy_from_slice(&half::f16::INFINITY.to_le_bytes()),
        }
        let bad = tmp.path().join(format!("nan-{outtype}.gguf"));
        std::fs::write(&bad, &b).unwrap();
        let m = bad.to_str().unwrap();
        let want = if outtype == "f32" {
            "blk.1.ffn_up.weight holds NaN"
        } else {
            "blk.1.ffn_up.weight holds a block whose scale is NaN or Inf"
        };
        for args in [
            vec!["info", m, "--check-tensors"],
            vec![
                "generate",
                "-m",
                m,
                "--prompt-ids",
                "1,2",
                "-n",
                "4",
                "--check-tensors",
            ],
            vec!["bench", "-m", m, "-p", "1", "-r", "1", "--check-tensors"],
        ] {
            assert_fails_with(&run(&args), &[want]);
        }
        let o = run(&["info", path.to_str().unwrap(), "--check-tensors"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stdout(&o).contains("hold finite values"), "{}", stdout(&o));
        let o = run(&["generate", "-m", m, "--prompt-ids", "1,2", "-n", "4"]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
}

/// What was accepted is said: a GGUF v2 file loads with a note, and the load line lists the
/// tensor types.
#[test]
fn a_gguf_v2_is_said_and_the_tensor_types_are_listed() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, mut bytes) = real_file(tmp.path(), "q8_0");
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let v2 = tmp.path().join("v2.gguf");
    std::fs::write(&v2, &bytes).unwrap();
    let o = run(&[
        "generate",
        "-m",
        v2.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "-n",
        "4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("is GGUF version 2 (read as version 3"),
        "{err}"
    );
    assert!(err.contains("tensors q8_0 15, f32 9)"), "{err}");
    let o = run(&["info", v2.to_str().unwrap()]);
    assert!(stdout(&o).contains("GGUF v2"), "{}", stdout(&o));
}
