//! Host crate for tarn's criterion benchmarks; each question has its own file beside this one
//! (`wal_insertion.rs`: what durable concurrent appends cost). Results: `docs/BENCHMARKS.md`.
