// The static (musl) build allocates with mimalloc: musl's own allocator is slow under threads
// and for a forward's large buffers (see Cargo.toml).
#[cfg(target_env = "musl")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    std::process::exit(refusion::cli::main());
}
