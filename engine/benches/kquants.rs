//! Our Q4_K/Q6_K kernels against candle's, one weight matrix
//! at a time: `cargo bench --bench kquants [-- q6k [ROWS [K [M,M,...]]]] [--ours]` (`--ours`:
//! our kernels alone, with GMAC/s, for tuning them). The matrix (7 MB at the
//! default 6144 x 2048) fits in a large L3, so this measures compute, not memory traffic: the
//! whole-model figures come from `refusion bench`.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use refusion_engine::model::kquants::{self, matmul_many, PackedMatrix};
use refusion_gguf::GgmlType;

fn main() -> candle_core::Result<()> {
    let ours_only = std::env::args().any(|a| a == "--ours");
    let args: Vec<String> = std::env::args()
        .filter(|a| a != "--bench" && a != "--ours")
        .collect();
    let (ty, dtype, block) = match args.get(1).map(String::as_str) {
        Some("q6k") => (GgmlType::Q6_K, GgmlDType::Q6K, 210),
        _ => (GgmlType::Q4_K, GgmlDType::Q4K, 144),
    };
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(6144);
    let k: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(2048);
    if !kquants::supports(ty, k) {
        println!("this CPU (or k = {k}) does not run our kernels: nothing to compare");
        return Ok(());
    }
    let mut seed = 1u64;
    let mut rand = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let wf: Vec<f32> = (0..n * k).map(|_| rand()).collect();
    let mut data = vec![0u8; n * k / 256 * block];
    refusion_gguf::quant::quantize(ty, &wf, k, &mut data);
    let storage = QStorage::from_data(Cow::Borrowed(&data), &Device::Cpu, dtype)?;
    let candle = QMatMul::from_arc(Arc::new(QTensor::new(storage, (n, k))?))?;
    let ours = PackedMatrix::pack(ty, n, k, &data);
    println!("{ty} {n}x{k}, {} threads", rayon::current_num_threads());
    let ms: Vec<usize> = match args.get(4) {
        Some(list) => list.split(',').filter_map(|m| m.parse().ok()).collect(),
        None => vec![1, 2, 4, 16, 32, 64, 256],
    };
    for m in ms {
        if ours_only {
            let x: Vec<f32> = (0..m * k).map(|_| rand()).collect();
            let mut out = vec![0f32; m * n];
            matmul_many(&[&ours], &x, m, &mut [&mut out]);
            // The best of 7 rounds: a shared machine's noise only ever slows a round down.
            let reps = (500 / m).max(10);
            let mut secs = f64::INFINITY;
            for _ in 0..7 {
                let t = Instant::now();
                for _ in 0..reps {
                    matmul_many(&[&ours], &x, m, &mut [&mut out]);
                }
                secs = secs.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            let gmac = (m * n * k) as f64 / secs / 1e9;
            println!("m={m:4}: ours {:8.3} ms  {gmac:6.1} GMAC/s", secs * 1e3);
            continue;
        }
        let x: Vec<f32> = (0..m * k).map(|_| rand()).collect();
        let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu)?;
        let want: Vec<f32> = candle.forward(&xt)?.flatten_all()?.to_vec1()?;
        let mut out = vec![0f32; m * n];
        matmul_many(&[&ours], &x, m, &mut [&mut out]);
        let diff = want
            .iter()
            .zip(&out)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let reps = (200 / m).max(3);
        let t = Instant::now();
        for _ in 0..reps {
            candle.forward(&xt)?;
        }
        let t_candle = t.elapsed().as_secs_f64() / reps as f64;
        let t = Instant::now();
        for _ in 0..reps {
            matmul_many(&[&ours], &x, m, &mut [&mut out]);
        }
        let t_ours = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "m={m:4}: candle {:8.3} ms  ours {:8.3} ms  candle/ours {:5.2}  max |diff| {diff:.1e}",
            t_candle * 1e3,
            t_ours * 1e3,
            t_candle / t_ours
        );
    }
    Ok(())
}
