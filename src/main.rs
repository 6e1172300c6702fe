fn main() {
    std::process::exit(refusion::cli::main());
}
