//! `refusion serve`: the OpenAI-compatible server.

use std::net::IpAddr;
use std::time::Duration;

use anyhow::Result;
use clap::Args;

use refusion_gguf::decoding::MAX_TOKENS;

use super::generate::DecodeArgs;
use super::model_args::ModelArgs;
use refusion_engine::load::runtime::load;
use refusion_server::worker::Limits;
use refusion_server::{check_access, serve, ConnLimits, ServerConfig};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    decode: DecodeArgs,
    /// Address to listen on, or a host name (`localhost`): loopback by default.
    #[arg(long, default_value = "127.0.0.1", value_parser = parse_host)]
    host: IpAddr,
    /// Port (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` (needed when binding beyond loopback).
    #[arg(long)]
    api_key: Option<String>,
    /// Requests that may wait for the model; more get HTTP 503.
    #[arg(long, default_value_t = 16, allow_negative_numbers = true)]
    queue: usize,
    /// Requests decoded together, as rows of one forward (continuous batching; llama-server's
    /// -np). Each holds its prompt, answer and a block of scratch in the KV cache (-c).
    #[arg(
        long = "parallel",
        default_value_t = 4,
        value_name = "N",
        allow_negative_numbers = true
    )]
    parallel: usize,
    /// Largest request body accepted (HTTP 413 beyond).
    #[arg(long, default_value_t = 1 << 20, allow_negative_numbers = true)]
    max_body_bytes: usize,
    /// Largest max_tokens a request may ask for.
    #[arg(long, default_value_t = 2048, allow_negative_numbers = true)]
    max_gen_length: u32,
    /// More in the request log (the user agent, body sizes).
    #[arg(short = 'v', long)]
    verbose: bool,
    /// The model id reported by /v1/models (default: general.name).
    #[arg(short = 'a', long)]
    alias: Option<String>,
    /// llama-server's -cb: continuous batching, always on here (accepted).
    #[arg(long = "cont-batching", hide = true)]
    cont_batching: bool,
    /// llama-server's -nocb: refused by name (requests always share forwards).
    #[arg(long = "no-cont-batching", hide = true)]
    no_cont_batching: bool,
    /// llama-server's -to/--timeout (its read/write timeout): here how long a request's
    /// headers and its body may each take; an answer being written is never timed out.
    #[arg(long = "timeout", value_name = "SECS")]
    timeout: Option<f64>,
    /// llama-server's --jinja: chat templates are always rendered as Jinja here (accepted).
    #[arg(long, hide = true)]
    jinja: bool,
    /// llama-server's --metrics: `/metrics` is always served here (accepted).
    #[arg(long, hide = true)]
    metrics: bool,
    /// llama-server's --slots: `GET /slots` is always served (accepted).
    #[arg(long, hide = true)]
    slots: bool,
    /// Seconds a request's headers may take, from its first byte.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    header_timeout: f64,
    /// Seconds a request's body may take, after its headers (HTTP 408 beyond).
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    body_timeout: f64,
    /// Seconds an idle keep-alive connection is kept open.
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    idle_timeout: f64,
    /// Open connections at most; more are answered 503 and closed.
    #[arg(
        long,
        default_value_t = 256,
        value_name = "N",
        allow_negative_numbers = true
    )]
    max_connections: usize,
    /// Let web pages from this origin call the API (`scheme://host[:port]`; repeatable; `*`
    /// for any, only with --api-key). Loopback origins and the server's own page always may.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origin: Vec<String>,
    /// Do not serve the web page at `/`.
    #[arg(long)]
    no_webui: bool,
    /// Seconds responses in flight get to end after SIGINT/SIGTERM (generations are cancelled).
    #[arg(long, default_value_t = 5.0, value_name = "SECS")]
    shutdown_timeout: f64,
}

/// A positive, finite number of seconds.
fn seconds(flag: &str, v: f64) -> Result<Duration> {
    if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
        anyhow::bail!("{flag} must be more than 0 and at most 86400 seconds, got {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

/// The cap only protects the process if it opens fewer connections than it may have files:
/// says so when `ulimit -n` (Linux's soft limit, read from /proc) is lower.
fn warn_if_beyond_fd_limit(max_connections: usize) {
    let soft = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|v| v.parse::<usize>().ok())
        });
    // Files the process holds besides connections: the model, the KV cache, stdio, the runtime.
    const OTHER_FILES: usize = 64;
    if let Some(soft) = soft.filter(|&s| max_connections + OTHER_FILES > s) {
        eprintln!(
            "warning: --max-connections {max_connections} is near or beyond the open-file limit ({soft}): raise `ulimit -n` or lower --max-connections"
        );
    }
}

/// The request log on stderr: `-v` for more, `--log-disable` for none.
fn init_log(verbose: bool, disabled: bool) {
    use tracing_subscriber::filter::LevelFilter;
    let level = match (disabled, verbose) {
        (true, _) => LevelFilter::OFF,
        (false, true) => LevelFilter::DEBUG,
        (false, false) => LevelFilter::INFO,
    };
    // Only our lines: hyper and tokio log through `tracing` too, at DEBUG and below.
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

pub fn run(a: ServeArgs) -> Result<()> {
    a.decode.check()?;
    init_log(a.verbose, a.model.log_disable);
    super::set_threads(a.model.threads)?;
    if !(1..=65_536).contains(&a.queue) {
        anyhow::bail!("--queue must be between 1 and 65536, got {}", a.queue);
    }
    if !(1..=MAX_TOKENS).contains(&a.max_gen_length) {
        anyhow::bail!(
            "--max-gen-length must be between 1 and {MAX_TOKENS}, got {}",
            a.max_gen_length
        );
    }
    if a.max_body_bytes == 0 || a.max_body_bytes > 1 << 30 {
        anyhow::bail!(
            "--max-body-bytes must be between 1 and {} (1 GiB), got {}",
            1u64 << 30,
            a.max_body_bytes
        );
    }
    if !(1..=256).contains(&a.parallel) {
        anyhow::bail!("--parallel must be between 1 and 256, got {}", a.parallel);
    }
    if a.no_cont_batching {
        anyhow::bail!(
            "-nocb is not supported: requests always share forwards (continuous batching); -np 1 decodes one request at a time"
        );
    }
    let _ = (a.cont_batching, a.jinja, a.metrics, a.slots);
    check_access(a.host, a.api_key.as_deref())?;
    refusion_server::Cors::new(&a.cors_origin, a.host, a.api_key.as_deref())?;
    if !(1..=65_536).contains(&a.max_connections) {
        anyhow::bail!(
            "--max-connections must be between 1 and 65536, got {}",
            a.max_connections
        );
    }
    warn_if_beyond_fd_limit(a.max_connections);
    let (header_timeout, body_timeout) = match a.timeout {
        Some(t) => {
            let t = seconds("--timeout", t)?;
            (t, t)
        }
        None => (
            seconds("--header-timeout", a.header_timeout)?,
            seconds("--body-timeout", a.body_timeout)?,
        ),
    };
    let conn = ConnLimits {
        headers: header_timeout,
        body: body_timeout,
        idle: seconds("--idle-timeout", a.idle_timeout)?,
        grace: seconds("--shutdown-timeout", a.shutdown_timeout)?,
        max_connections: a.max_connections,
    };
    // The worker's cache holds the context and room for an answer beyond it: planned so.
    let mut model = a.model.clone();
    model.take_ollama_cache_type()?;
    let mut opts = model.load_options(true)?;
    opts.kv_extra = a.max_gen_length as usize;
    let loaded = load(&opts)?;
    let base = a.decode.params(&loaded.file.header, &loaded.tokenizer)?;
    let model_name = a.alias.clone().unwrap_or_else(|| {
        loaded
            .file
            .header
            .get("general.name")
            .and_then(|v| v.as_str())
            .unwrap_or("refusion")
            .to_string()
    });
    let limits = Limits {
        max_gen_length: max_gen_that_fits(a.max_gen_length.max(1), &base, loaded.context)?,
        base,
        parallel: a.parallel,
    };
    let cfg = ServerConfig {
        host: a.host,
        port: a.port,
        api_key: a.api_key.clone(),
        queue: a.queue,
        max_body_bytes: a.max_body_bytes,
        model_name,
        conn,
        cors_origins: a.cors_origin.clone(),
        webui: !a.no_webui,
    };
    serve(loaded, limits, cfg)?;
    Ok(())
}

/// The largest `max_tokens` the server advertises and accepts: `--max-gen-length`, lowered
/// (with a note) to what a one-token prompt, the answer rounded up to whole slots and a serial
/// block of scratch leave room for in the context.
fn max_gen_that_fits(
    asked: u32,
    base: &refusion_engine::decode::DecodeParams,
    context: usize,
) -> Result<u32> {
    let k = base.slot_size.max(1) as usize;
    let scratch = (base.block_len() as usize).max(k);
    let fits = context.saturating_sub(1 + scratch + (k - 1));
    if fits == 0 {
        anyhow::bail!(
            "the context of {context} tokens leaves no room for an answer (a serial block of {scratch} tokens is scratch): raise -c"
        );
    }
    if asked as usize > fits {
        eprintln!(
            "note: max_tokens is limited to {fits}: --max-gen-length {asked} would not fit the context of {context} with a prompt (raise -c for more)"
        );
        return Ok(fits as u32);
    }
    Ok(asked)
}

/// `--host`: an address, or a name resolved now (`localhost`: its loopback address), as
/// llama-server takes it.
fn parse_host(s: &str) -> std::result::Result<IpAddr, String> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(ip);
    }
    use std::net::ToSocketAddrs;
    let addrs: Vec<IpAddr> = (s, 0)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve host name '{s}': {e}"))?
        .map(|a| a.ip())
        .collect();
    // IPv4 first, as most clients try it first for `localhost`.
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("host name '{s}' has no address"))
}
