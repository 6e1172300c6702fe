#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| refusion::fuzzing::server_request(data));
