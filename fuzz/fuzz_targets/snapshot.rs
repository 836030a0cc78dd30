//! Snapshot decoding (what `verify_snapshot` and a restore run on an uploaded file) on arbitrary
//! bytes: never a panic, and no allocation a hostile length could make huge.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tarn_collection::fuzzing::decode_snapshot(data);
});
