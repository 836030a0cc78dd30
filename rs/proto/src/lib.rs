//! Generated code only: the `tarn.v1` messages, the `Tarn` client and server, and the encoded
//! file descriptor set for gRPC reflection. Protobuf types never leave `rs/server` (and clients).
#![allow(clippy::all, clippy::pedantic, clippy::unwrap_used)]

pub mod v1 {
    tonic::include_proto!("tarn.v1");

    /// The encoded `FileDescriptorSet` of tarn.proto, for the reflection service.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/tarn_descriptor.bin"));
}
