//! Compiles proto/tarn/v1/tarn.proto with protox (a pure-Rust protobuf compiler, so no system
//! `protoc` is needed) and generates the tonic client and server, plus the encoded descriptor set
//! that the server's reflection service publishes.

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let proto = proto_root.join("tarn/v1/tarn.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let descriptors = protox::compile([&proto], [&proto_root])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("tarn_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
