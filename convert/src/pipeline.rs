//! The streaming conversion loop shared by `convert` and `quantize`: for each tensor, decode a
//! chunk of rows to f32, check it, encode it on all cores, append it to the GGUF, release the
//! input pages, and move on. Peak memory is a chunk of rows, never a whole model.

use std::io::{BufWriter, IsTerminal};
use std::path::Path;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::error::{Error, Result};
use crate::gguf::{GgufWriter, TensorSpec, Value};
use crate::output::{check_interrupt, install_interrupt_handler, AtomicFile};
use crate::quant;

/// Rows of f32 decoded at once: about 16 MiB, whatever the row length.
const CHUNK_F32: usize = 4 << 20;

/// Where a tensor's rows come from.
pub trait RowSource: Sync {
    /// Decodes rows `first..first+count` (each `row_len` long) into `out`.
    fn read_rows(&self, first: usize, count: usize, out: &mut [f32]);
    /// The input bytes this tensor reads.
    fn input_bytes(&self) -> u64;
    /// Called once rows `first..first+count` are written, to drop their input pages.
    fn release_rows(&self, _first: usize, _count: usize) {}
    /// Names the input for error messages, e.g. the file the tensor comes from.
    fn origin(&self) -> String;
    /// The input's element type, for the log.
    fn input_type(&self) -> String;
    /// The tensor's name in the input, for error messages.
    fn source_name(&self) -> String;
    /// Writes rows `first..first+count` already encoded as `ty` into `out`, when the source
    /// can (synthetic weights tile pre-encoded rows); `false` sends them through `read_rows`
    /// and the quantizer.
    fn encoded_rows(
        &self,
        _ty: crate::gguf::GgmlType,
        _first: usize,
        _count: usize,
        _out: &mut [u8],
    ) -> bool {
        false
    }
}

pub struct Job<'a> {
    pub spec: TensorSpec,
    pub source: Box<dyn RowSource + 'a>,
    /// Why the type differs from what was asked (a fallback), for the log.
    pub note: Option<String>,
}

#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub n_tensors: usize,
    pub n_elements: u64,
    pub input_bytes: u64,
    pub output_bytes: u64,
    /// The tensors' data alone (no metadata, no alignment padding).
    pub tensor_bytes: u64,
    pub elapsed: Duration,
}

impl Summary {
    pub fn bits_per_weight(&self) -> f64 {
        if self.n_elements == 0 {
            0.0
        } else {
            // As `refusion info` and llama.cpp count it: tensor data over weights.
            self.tensor_bytes as f64 * 8.0 / self.n_elements as f64
        }
    }
}

/// How chatty the conversion is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verbosity {
    Quiet,
    Normal,
}

pub fn write_gguf(
    target: &Path,
    metadata: &[(String, Value)],
    jobs: Vec<Job<'_>>,
    verbosity: Verbosity,
) -> Result<Summary> {
    install_interrupt_handler();
    let start = Instant::now();
    let specs: Vec<TensorSpec> = jobs.iter().map(|j| j.spec.clone()).collect();
    let total_input: u64 = jobs.iter().map(|j| j.source.input_bytes()).sum();
    let n_elements: u64 = specs.iter().map(|s| s.ne.iter().product::<u64>()).sum();
    let tensor_bytes: u64 = specs
        .iter()
        .map(|s| {
            let rows: u64 = s.ne.iter().skip(1).product();
            s.ne.first()
                .and_then(|&n| s.ty.row_bytes(n))
                .map_or(0, |b| b * rows)
        })
        .sum();

    let mut out = AtomicFile::create(target)?;
    let partial = out.temp_path().to_path_buf();
    let io_err = |e: std::io::Error| Error::io(&partial, e);

    let bar = progress_bar(verbosity, total_input);
    let mut writer = GgufWriter::new(
        BufWriter::with_capacity(1 << 20, out.file()),
        metadata,
        &specs,
    )
    .map_err(io_err)?;
    let n_jobs = jobs.len();
    let mut bufs = (Vec::new(), Vec::new());
    for (i, job) in jobs.iter().enumerate() {
        announce(bar.as_ref(), verbosity, (i, n_jobs), job);
        write_tensor(&mut writer, job, &mut bufs, bar.as_ref(), &partial)?;
    }
    let buffered = writer.finish().map_err(io_err)?;
    buffered.into_inner().map_err(|e| io_err(e.into_error()))?;
    let output_bytes = out.file().metadata().map_err(io_err)?.len();
    check_interrupt()?;
    out.commit()?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(Summary {
        n_tensors: n_jobs,
        n_elements,
        input_bytes: total_input,
        output_bytes,
        tensor_bytes,
        elapsed: start.elapsed(),
    })
}

/// A progress bar on a terminal (normal verbosity), over the input's bytes.
fn progress_bar(verbosity: Verbosity, total_input: u64) -> Option<ProgressBar> {
    if verbosity != Verbosity::Normal || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::with_draw_target(Some(total_input), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>9} {msg:<28!} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    Some(bar)
}

/// Tensor `i` of `n` being written: on the bar, or a line on stderr (a line above the bar
/// when the job carries a note).
fn announce(
    bar: Option<&ProgressBar>,
    verbosity: Verbosity,
    (i, n): (usize, usize),
    job: &Job<'_>,
) {
    let spec = &job.spec;
    let line = format!(
        "[{:>4}/{:>4}] {:<28} {:>5} -> {:<5} {:?}{}",
        i + 1,
        n,
        spec.name,
        job.source.input_type(),
        spec.ty.name(),
        spec.ne,
        job.note
            .as_deref()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default()
    );
    match bar {
        Some(bar) => {
            bar.set_prefix(format!("{}/{n}", i + 1));
            bar.set_message(spec.name.clone());
            if job.note.is_some() {
                bar.println(line);
            }
        }
        None if verbosity == Verbosity::Normal => eprintln!("{line}"),
        None => {}
    }
}

/// One tensor's data, in chunks of rows: copied when the source holds it encoded already,
/// else read as f32 (every value finite), quantized and written. `bufs` are reused.
fn write_tensor<W: std::io::Write>(
    writer: &mut GgufWriter<W>,
    job: &Job<'_>,
    (f32_buf, out_buf): &mut (Vec<f32>, Vec<u8>),
    bar: Option<&ProgressBar>,
    partial: &Path,
) -> Result<()> {
    let io_err = |e: std::io::Error| Error::io(partial, e);
    let spec = &job.spec;
    let row_len = spec.ne[0] as usize;
    let n_rows: usize = spec.ne.iter().skip(1).product::<u64>() as usize;
    let row_bytes = spec.ty.row_bytes(spec.ne[0]).ok_or_else(|| {
        Error::usage(format!(
            "tensor '{}': row length {row_len} does not fit {}",
            spec.name, spec.ty
        ))
    })? as usize;
    let rows_per_chunk = (CHUNK_F32 / row_len.max(1)).clamp(1, n_rows.max(1));
    let input_per_row = job.source.input_bytes() / n_rows.max(1) as u64;
    let mut row = 0;
    while row < n_rows {
        check_interrupt()?;
        let count = rows_per_chunk.min(n_rows - row);
        out_buf.resize(count * row_bytes, 0);
        let encoded = job.source.encoded_rows(spec.ty, row, count, out_buf);
        if !encoded {
            f32_buf.resize(count * row_len, 0.0);
            job.source.read_rows(row, count, f32_buf);
            if let Some(pos) = f32_buf.iter().position(|v| !v.is_finite()) {
                return Err(Error::bad(
                    job.source.origin(),
                    format!(
                        "tensor '{}' holds a non-finite value ({}) at row {}, column {}",
                        job.source.source_name(),
                        f32_buf[pos],
                        row + pos / row_len,
                        pos % row_len
                    ),
                ));
            }
            out_buf.resize(count * row_bytes, 0);
            quant::quantize(spec.ty, f32_buf, row_len, out_buf);
        }
        writer.write_data(out_buf).map_err(io_err)?;
        if let Some(bar) = bar {
            bar.inc(input_per_row * count as u64);
        }
        if !encoded {
            job.source.release_rows(row, count);
        }
        row += count;
    }
    Ok(())
}
