//! WAL payload (operation) decoding on arbitrary bytes and dimensions: never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some((&dim, rest)) = data.split_first() {
        let _ = tarn_collection::fuzzing::decode_operation(rest, dim as usize);
    }
});
