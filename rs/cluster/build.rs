//! Compiles tarn's copy of etcd's v3 API (proto/etcd/*.proto: KV, Watch, Lease, Election) with
//! protox, a pure-Rust protobuf compiler, into tonic clients: building tarn needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = [
        proto_root.join("etcd/rpc.proto"),
        proto_root.join("etcd/v3election.proto"),
    ];
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let descriptors = protox::compile(&files, [&proto_root])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(descriptors)?;
    Ok(())
}
