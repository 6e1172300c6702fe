//! Tests of the module above.

use super::*;

fn shape() -> CacheShape {
    CacheShape {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 4,
        capacity: 16,
    }
}

/// K/V values that encode (layer, kv head, tag) so copies can be traced.
fn kv_for(layer: usize, tags: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut k = Vec::new();
    let mut v = Vec::new();
    for &t in tags {
        for h in 0..2 {
            for d in 0..4 {
                k.push(t * 100.0 + (layer * 10 + h) as f32 + d as f32 * 0.01);
                v.push(-(t * 100.0 + (layer * 10 + h) as f32 + d as f32 * 0.01));
            }
        }
    }
    (k, v)
}

fn tag_of(c: &KvCache, layer: usize, slot: usize) -> f32 {
    let k = c.entry(layer, Kv::K, 1, slot).unwrap();
    ((k[0] - (layer * 10 + 1) as f32) / 100.0).round()
}

fn fill(c: &mut KvCache, rows: &[u32], tags: &[f32]) -> Vec<usize> {
    let positions: Vec<u32> = tags.iter().map(|&t| t as u32).collect();
    let slots = c.allocate(rows, &positions).unwrap();
    for layer in 0..2 {
        let (k, v) = kv_for(layer, tags);
        if layer < c.device_layers() {
            let dev = c.device_layer(layer).k.device().clone();
            let index = c.device_index(&slots, &dev).unwrap();
            let k = Tensor::from_vec(k, (slots.len(), 2, 4), &dev).unwrap();
            let v = Tensor::from_vec(v, (slots.len(), 2, 4), &dev).unwrap();
            c.write_device(layer, &index, &k, &v).unwrap();
        } else {
            c.write(layer, &slots, &k, &v);
        }
    }
    slots
}

fn check_ops(mut c: KvCache) {
    // A prompt of 3 entries, committed.
    fill(&mut c, &[0, 0, 0], &[1.0, 2.0, 3.0]);
    c.commit_row(0).unwrap();
    assert_eq!(c.shared_len(), 3);
    assert_eq!(c.shared_positions(), &[1, 2, 3]);
    // Two rows of two entries each, interleaved in the batch.
    fill(&mut c, &[0, 1, 0, 1], &[10.0, 20.0, 11.0, 21.0]);
    assert_eq!(c.row_len(0), 2);
    assert_eq!(c.row_len(1), 2);
    assert_eq!(c.available(), 16 - 3 - 4);
    // Truncate rows to one entry each, then add one more to each row.
    c.truncate_rows(1);
    assert_eq!(c.row_len(0), 1);
    fill(&mut c, &[0, 1], &[12.0, 22.0]);
    let r0: Vec<f32> = c.row_slots(0).iter().map(|&s| tag_of(&c, 1, s)).collect();
    let r1: Vec<f32> = c.row_slots(1).iter().map(|&s| tag_of(&c, 1, s)).collect();
    assert_eq!(r0, vec![10.0, 12.0]);
    assert_eq!(r1, vec![20.0, 22.0]);
    // Commit row 1's entries then row 0's first, in that order.
    c.commit(&[(1, 0), (1, 1), (0, 0)]).unwrap();
    assert_eq!(c.shared_len(), 6);
    assert_eq!(c.n_rows(), 0);
    let shared: Vec<f32> = (0..6).map(|s| tag_of(&c, 0, s)).collect();
    assert_eq!(shared, vec![1.0, 2.0, 3.0, 20.0, 22.0, 10.0]);
    assert_eq!(c.shared_positions(), &[1, 2, 3, 20, 22, 10]);
    let v = c.entry(1, Kv::V, 0, 5).unwrap()[1];
    match c.types().v {
        CacheType::F32 => assert_eq!(v, -(10.0 * 100.0 + 10.0 + 0.01)),
        CacheType::F16 => assert!((v + 1010.01).abs() < 1.0),
        // The block types need whole blocks (32 values): tested at head size 32 below.
        other => panic!("{other:?} at head size 4"),
    }
    // Drop rows beyond the first, crop the shared prefix, remove entries.
    fill(&mut c, &[0, 1, 2], &[30.0, 31.0, 32.0]);
    c.retain_rows(1);
    assert_eq!(c.n_rows(), 1);
    c.retain_shared(|_, p| p != 20).unwrap();
    assert_eq!(c.shared_positions(), &[1, 2, 3, 22, 10]);
    let shared: Vec<f32> = (0..5).map(|s| tag_of(&c, 0, s)).collect();
    assert_eq!(shared, vec![1.0, 2.0, 3.0, 22.0, 10.0]);
    c.crop(2);
    assert_eq!(c.shared_len(), 2);
    assert_eq!(c.available(), 14);
    // Filling the context is an error that changes nothing.
    let err = c.allocate(&[0; 15], &[0; 15]).unwrap_err();
    assert!(err.to_string().contains("context"), "{err}");
    assert_eq!(c.row_len(0), 0);
    assert!(c.commit(&[(3, 0)]).is_err());
}

#[test]
fn cache_operations_f32_f16_and_file_backed() {
    check_ops(KvCache::new(shape(), CacheType::F32).unwrap());
    check_ops(KvCache::new(shape(), CacheType::F16).unwrap());
    // Keys and values of different types, their arrays of different sizes.
    for (k, v) in [
        (CacheType::F16, CacheType::F32),
        (CacheType::F32, CacheType::F16),
    ] {
        check_ops(KvCache::new(shape(), KvTypes { k, v }).unwrap());
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kv.bin");
    let c = KvCache::with_file(shape(), CacheType::F32, &path).unwrap();
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        host::FILE_HEADER_BYTES + (shape().bytes_per_token(CacheType::F32) * 16) as u64
    );
    // A second cache on the same file is refused while the first holds it.
    let e = KvCache::with_file(shape(), CacheType::F32, &path)
        .err()
        .expect("locked")
        .to_string();
    assert!(e.contains("in use by another refusion"), "{e}");
    check_ops(c);
}

#[test]
fn device_resident_layers_behave_as_mapped_ones() {
    // candle's CPU device stands in for a GPU: the same tensor operations run on both.
    for n in [1, 2] {
        for ty in [
            KvTypes::same(CacheType::F32),
            KvTypes::same(CacheType::F16),
            KvTypes {
                k: CacheType::F16,
                v: CacheType::F32,
            },
        ] {
            let c = KvCache::placed(shape(), ty, None, Some((&Device::Cpu, n))).unwrap();
            assert_eq!(c.device_layers(), n);
            check_ops(c);
        }
    }
}

#[test]
fn saved_prefixes_move_between_device_and_mapped_layers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prefix.kv");
    let mut c = KvCache::placed(shape(), CacheType::F16, None, Some((&Device::Cpu, 1))).unwrap();
    fill(&mut c, &[0, 0, 0], &[0.0, 2.0, 1.0]);
    c.commit_row(0).unwrap();
    c.save_prefix(&path, 42, &[7, 8, 9], b"x").unwrap();
    let mut host = KvCache::new(shape(), CacheType::F16).unwrap();
    host.load_prefix(&path, 42).unwrap();
    let path2 = dir.path().join("prefix2.kv");
    host.save_prefix(&path2, 42, &[7, 8, 9], b"x").unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        std::fs::read(&path2).unwrap()
    );
    let mut dev = KvCache::placed(shape(), CacheType::F16, None, Some((&Device::Cpu, 2))).unwrap();
    dev.load_prefix(&path2, 42).unwrap();
    for layer in 0..2 {
        for slot in 0..3 {
            for is_v in [Kv::K, Kv::V] {
                assert_eq!(
                    dev.entry(layer, is_v, 1, slot).unwrap(),
                    c.entry(layer, is_v, 1, slot).unwrap()
                );
            }
        }
    }
}

/// Keys and values of different types (`-ctk q8_0 -ctv f16`): rows of each kind read back
/// within their own type's rounding, a saved prefix moves between the map and device layers and
/// names the pair, and a cache of the swapped pair refuses it.
#[test]
fn keys_and_values_of_different_types() {
    let wide = CacheShape {
        head_dim: 32,
        ..shape()
    };
    let types = KvTypes {
        k: CacheType::Q8_0,
        v: CacheType::F16,
    };
    let mut c = KvCache::new(wide, types).unwrap();
    let slots = c.allocate(&[0, 0, 0], &[0, 1, 2]).unwrap();
    let k: Vec<f32> = (0..3 * 2 * 32)
        .map(|i| ((i * 31) % 53) as f32 * 0.1 - 2.5)
        .collect();
    let v: Vec<f32> = k.iter().map(|x| x * 3.0 + 0.5).collect();
    for layer in 0..2 {
        c.write(layer, &slots, &k, &v);
    }
    c.commit_row(0).unwrap();
    for (i, &slot) in slots.iter().enumerate() {
        let want = |all: &[f32]| all[(i * 2 + 1) * 32..(i * 2 + 2) * 32].to_vec();
        let got_k = c.entry(1, Kv::K, 1, slot).unwrap();
        let got_v = c.entry(1, Kv::V, 1, slot).unwrap();
        for (a, b) in got_k.iter().zip(want(&k)) {
            assert!((a - b).abs() <= 2.6 / 127.0, "key {b} read back as {a}");
        }
        for (a, b) in got_v.iter().zip(want(&v)) {
            assert!(
                (a - b).abs() <= b.abs() * 1e-3,
                "value {b} read back as {a}"
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mixed.kv");
    c.save_prefix(&path, 42, &[7, 8, 9], b"").unwrap();
    let mut d = KvCache::new(wide, types).unwrap();
    d.load_prefix(&path, 42).unwrap();
    for layer in 0..2 {
        for kind in [Kv::K, Kv::V] {
            for s in 0..3 {
                assert_eq!(
                    d.entry(layer, kind, 0, s).unwrap(),
                    c.entry(layer, kind, 0, s).unwrap()
                );
            }
        }
    }
    let swapped = KvTypes {
        k: CacheType::F16,
        v: CacheType::Q8_0,
    };
    let e = KvCache::new(wide, swapped)
        .unwrap()
        .load_prefix(&path, 42)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("KV cache of K q8_0, V f16, this run's is K f16, V q8_0"),
        "{e}"
    );
    // Device layers (f16 keys, f32 values there) write and read the file's entries the same.
    let dev_types = KvTypes {
        k: CacheType::F16,
        v: CacheType::F32,
    };
    let mut host = KvCache::new(wide, dev_types).unwrap();
    let slots = host.allocate(&[0, 0, 0], &[0, 1, 2]).unwrap();
    for layer in 0..2 {
        host.write(layer, &slots, &k, &v);
    }
    host.commit_row(0).unwrap();
    let p2 = dir.path().join("dev.kv");
    host.save_prefix(&p2, 42, &[7, 8, 9], b"").unwrap();
    let mut dev = KvCache::placed(wide, dev_types, None, Some((&Device::Cpu, 1))).unwrap();
    dev.load_prefix(&p2, 42).unwrap();
    let p3 = dir.path().join("dev2.kv");
    dev.save_prefix(&p3, 42, &[7, 8, 9], b"").unwrap();
    assert_eq!(std::fs::read(&p2).unwrap(), std::fs::read(&p3).unwrap());
}

#[test]
fn saved_prefixes_round_trip_and_mismatches_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prefix.kv");
    let mut c = KvCache::new(shape(), CacheType::F32).unwrap();
    // Positions committed out of order, as ReFusion does.
    fill(&mut c, &[0, 0, 0], &[0.0, 2.0, 1.0]);
    c.commit_row(0).unwrap();
    c.save_prefix(&path, 42, &[7, 8, 9], b"extra").unwrap();
    let mut d = KvCache::new(shape(), CacheType::F32).unwrap();
    let saved = d.load_prefix(&path, 42).unwrap();
    assert_eq!(saved.tokens, vec![7, 8, 9]);
    assert_eq!(saved.extra, b"extra");
    assert_eq!(d.shared_positions(), &[0, 2, 1]);
    assert_eq!(
        (0..3).map(|s| tag_of(&d, 1, s)).collect::<Vec<_>>(),
        vec![0.0, 2.0, 1.0]
    );
    let e = d.load_prefix(&path, 43).unwrap_err().to_string();
    assert!(e.contains("another model"), "{e}");
    assert_eq!(
        d.shared_positions(),
        &[0, 2, 1],
        "a refused file leaves the cache as it was"
    );
    let mut h = KvCache::new(shape(), CacheType::F16).unwrap();
    let e = h.load_prefix(&path, 42).unwrap_err().to_string();
    assert!(
        e.contains("KV cache of f32, this run's is f16 (give -ctk f32 -ctv f32)"),
        "{e}"
    );
    // A file of version 1 (one type code for keys and values) still loads.
    let mut v1 = std::fs::read(&path).unwrap();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    v1[16..20].copy_from_slice(&CacheType::F32.kind().code().to_le_bytes());
    let old = dir.path().join("v1.kv");
    std::fs::write(&old, &v1).unwrap();
    let mut d1 = KvCache::new(shape(), CacheType::F32).unwrap();
    assert_eq!(d1.load_prefix(&old, 42).unwrap().tokens, vec![7, 8, 9]);
    assert_eq!(d1.shared_positions(), &[0, 2, 1]);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    assert!(d
        .load_prefix(&path, 42)
        .unwrap_err()
        .to_string()
        .contains("truncated"));
    let mut flipped = bytes.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    std::fs::write(&path, &flipped).unwrap();
    assert!(d
        .load_prefix(&path, 42)
        .unwrap_err()
        .to_string()
        .contains("checksum"));
    assert!(
        c.save_prefix(&path, 42, &[1, 2, 3, 4], b"").is_err(),
        "position 3 is not cached"
    );
}

#[test]
fn bytes_per_token_matches_refusion_8b() {
    let s = CacheShape {
        n_layers: 36,
        n_kv_heads: 8,
        head_dim: 128,
        capacity: 1,
    };
    assert_eq!(s.bytes_per_token(CacheType::F16), 147_456);
}

/// The block types (llama.cpp's `-ctk q8_0` ...): whole blocks only, rows read back within
/// their rounding through every storage (map, file), saved prefixes carry the type.
#[test]
fn block_types_store_rows_and_their_prefix_files_name_them() {
    let wide = CacheShape {
        head_dim: 32,
        ..shape()
    };
    let e = KvCache::new(shape(), CacheType::Q8_0)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("multiple of 32") && e.contains("q8_0"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    for ty in [CacheType::Q8_0, CacheType::Q4_0, CacheType::Bf16] {
        let mut c = KvCache::new(wide, ty).unwrap();
        let positions = [0u32, 1, 2];
        let slots = c.allocate(&[0, 0, 0], &positions).unwrap();
        let n = 3 * 2 * 32;
        let k: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 61) as f32 * 0.1 - 3.0)
            .collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        for layer in 0..2 {
            c.write(layer, &slots, &k, &v);
        }
        c.commit_row(0).unwrap();
        let tol = match ty {
            CacheType::Q4_0 => 3.0 / 7.0,
            _ => 3.0 / 100.0,
        };
        for (i, &slot) in slots.iter().enumerate() {
            let got = c.entry(1, Kv::V, 1, slot).unwrap();
            let want = &v[(i * 2 + 1) * 32..(i * 2 + 2) * 32];
            for (a, b) in got.iter().zip(want) {
                assert!((a - b).abs() <= tol, "{ty:?}: {b} read back as {a}");
            }
        }
        let path = dir.path().join(format!("{}.kv", ty.name()));
        c.save_prefix(&path, 42, &[7, 8, 9], b"").unwrap();
        let mut d = KvCache::new(wide, ty).unwrap();
        d.load_prefix(&path, 42).unwrap();
        for s in 0..3 {
            assert_eq!(
                d.entry(0, Kv::K, 0, s).unwrap(),
                c.entry(0, Kv::K, 0, s).unwrap()
            );
        }
        let mut f = KvCache::new(wide, CacheType::F32).unwrap();
        let e = f.load_prefix(&path, 42).unwrap_err().to_string();
        assert!(e.contains(&format!("KV cache of {}", ty.name())), "{e}");
    }
}
