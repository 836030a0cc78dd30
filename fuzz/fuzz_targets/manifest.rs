//! Checkpoint manifest and collection config decoding on arbitrary bytes: never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tarn_collection::fuzzing::decode_manifest(data);
    let _ = tarn_collection::fuzzing::decode_config(data);
});
