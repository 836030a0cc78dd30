//! Filtered search's decoders (schemas, documents' attributes, filters, sealed attribute
//! sections) on arbitrary bytes: never a panic, never an allocation beyond the input's bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tarn_collection::fuzzing::decode_attributes(data);
});
