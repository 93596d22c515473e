#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvx_fuzz_libfuzzer::run("wire_push_result", data));
