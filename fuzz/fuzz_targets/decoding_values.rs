#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| refusion::fuzzing::decoding_values(data));
