use super::*;
use std::io::Write;

fn write(target: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicFile::create(target)?;
    f.file().write_all(bytes).unwrap();
    f.commit()
}

fn temps(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(TEMP_SUFFIX))
        .collect()
}

#[test]
fn a_planted_partial_link_is_never_written_through() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim.gguf");
    std::fs::write(&victim, b"the user's model").unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, b"the user's notes").unwrap();
    let out = dir.path().join("out.gguf");
    // Every fixed name an older refusion used, and the hidden ones, as links.
    std::fs::hard_link(&victim, dir.path().join("out.gguf.partial")).unwrap();
    std::os::unix::fs::symlink(&notes, dir.path().join(".out.gguf.partial")).unwrap();
    write(&out, b"new bytes").unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), b"new bytes");
    assert_eq!(std::fs::read(&victim).unwrap(), b"the user's model");
    assert_eq!(std::fs::read(&notes).unwrap(), b"the user's notes");
}

#[test]
fn a_hard_linked_target_is_replaced_not_written_through() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim.gguf");
    std::fs::write(&victim, b"the user's model").unwrap();
    let out = dir.path().join("out.gguf");
    std::fs::hard_link(&victim, &out).unwrap();
    write(&out, b"new bytes").unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), b"new bytes");
    assert_eq!(std::fs::read(&victim).unwrap(), b"the user's model");
}

#[test]
fn a_target_that_is_a_link_or_not_a_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, b"the user's notes").unwrap();
    let link = dir.path().join("out.gguf");
    std::os::unix::fs::symlink(&notes, &link).unwrap();
    let e = write(&link, b"x").unwrap_err().to_string();
    assert!(e.contains("is a symbolic link; refusing"), "{e}");
    assert_eq!(std::fs::read(&notes).unwrap(), b"the user's notes");
    let dangling = dir.path().join("dangling.gguf");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
    assert!(write(&dangling, b"x").is_err());
    assert!(!dir.path().join("nowhere").exists());
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let e = write(&sub, b"x").unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
    assert!(temps(dir.path()).is_empty());
}

#[test]
fn a_link_swapped_in_while_writing_is_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, b"notes").unwrap();
    let out = dir.path().join("out.bin");
    let mut f = AtomicFile::create(&out).unwrap();
    f.file().write_all(b"new").unwrap();
    std::os::unix::fs::symlink(&notes, &out).unwrap();
    assert!(f.commit().is_err());
    assert!(std::fs::symlink_metadata(&out)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read(&notes).unwrap(), b"notes");
    assert!(temps(dir.path()).is_empty(), "the temporary is removed");
}

#[test]
fn writers_to_one_target_never_mix() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.bin");
    let a = vec![b'a'; 1 << 20];
    let b = vec![b'b'; 3 << 19];
    for _ in 0..20 {
        let mut fa = AtomicFile::create(&out).unwrap();
        let mut fb = AtomicFile::create(&out).unwrap();
        assert_ne!(fa.temp_path(), fb.temp_path());
        fa.file().write_all(&a[..1 << 19]).unwrap();
        fb.file().write_all(&b).unwrap();
        fa.file().write_all(&a[1 << 19..]).unwrap();
        fb.commit().unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b);
        fa.commit().unwrap();
        assert_eq!(
            std::fs::read(&out).unwrap(),
            a,
            "the last rename wins, whole"
        );
    }
    assert!(temps(dir.path()).is_empty());
}

#[test]
fn an_abandoned_write_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.bin");
    std::fs::write(&out, b"old").unwrap();
    let mut f = AtomicFile::create(&out).unwrap();
    f.file().write_all(b"half").unwrap();
    drop(f);
    assert_eq!(std::fs::read(&out).unwrap(), b"old");
    assert!(temps(dir.path()).is_empty());
}

#[test]
fn outputs_get_the_umask_mode_not_a_private_one() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.bin");
    write(&out, b"x").unwrap();
    let reference = dir.path().join("ref.bin");
    std::fs::File::create(&reference).unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&out), mode(&reference));
}

/// A leftover as a killed run leaves it: our naming, unlocked, and old.
fn leftover(dir: &Path, name: &str, random: &str) -> PathBuf {
    let p = dir.join(format!(".{name}.{random}{TEMP_SUFFIX}"));
    std::fs::write(&p, b"half a file").unwrap();
    let old = SystemTime::now() - Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(&p)
        .unwrap()
        .set_modified(old)
        .unwrap();
    p
}

#[test]
fn leftovers_of_killed_runs_are_swept_and_live_ones_kept() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gguf");
    let dead = leftover(dir.path(), "out.gguf", "Ab3dEf9h");
    // A live writer's temporary (locked), even when old.
    let live = leftover(dir.path(), "out.gguf", "LiVe0123");
    let holder = std::fs::File::open(&live).unwrap();
    holder.try_lock().unwrap();
    // Another target's leftover, a name that only looks like ours, and a fresh one.
    let other = leftover(dir.path(), "other.gguf", "Ab3dEf9h");
    let lookalike = leftover(dir.path(), "out.gguf", "notours!");
    let fresh = dir.path().join(".out.gguf.FrEsH123.partial");
    std::fs::write(&fresh, b"just created").unwrap();
    // A link with our naming is never followed or removed.
    let target = dir.path().join("notes.txt");
    std::fs::write(&target, b"notes").unwrap();
    let link = dir.path().join(".out.gguf.LiNk0123.partial");
    std::os::unix::fs::symlink(&target, &link).unwrap();

    write(&out, b"new").unwrap();
    assert!(!dead.exists(), "an abandoned leftover is removed");
    for kept in [&live, &other, &lookalike, &fresh, &link] {
        assert!(
            std::fs::symlink_metadata(kept).is_ok(),
            "{} was kept",
            kept.display()
        );
    }
    assert_eq!(std::fs::read(&target).unwrap(), b"notes");
    drop(holder);
}
