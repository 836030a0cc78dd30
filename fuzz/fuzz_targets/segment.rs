//! Sealed segment decoding (section tables, graphs, attribute and int8 sections) on arbitrary
//! bytes behind a valid checksum: never a panic, never an allocation beyond the input's bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tarn_collection::fuzzing::decode_segment(data);
});
