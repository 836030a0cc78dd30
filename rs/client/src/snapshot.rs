//! Snapshots over the wire: [`SnapshotStream`] (the chunks of `CreateSnapshot`, in order) and
//! the reader-fed request stream of `RestoreSnapshot`.

use tarn_proto::v1 as pb;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Code, Error, Result};
use crate::types::CollectionInfo;

/// Bytes of a snapshot file per restore message (well under the server's message limit).
pub(crate) const RESTORE_CHUNK_BYTES: usize = 1 << 20;

/// A snapshot being streamed from the server ([`crate::Client::create_snapshot`]): its sequence
/// number and size are known from the start; [`SnapshotStream::next_chunk`] gives the file's
/// bytes in order, and [`SnapshotStream::write_to`] copies them all to a writer.
#[derive(Debug)]
pub struct SnapshotStream {
    stream: tonic::Streaming<pb::SnapshotChunk>,
    first: Option<Vec<u8>>,
    seq_no: u64,
    total_bytes: u64,
    received: u64,
}

impl SnapshotStream {
    pub(crate) async fn start(mut stream: tonic::Streaming<pb::SnapshotChunk>) -> Result<Self> {
        let first = stream.message().await?.ok_or_else(|| {
            Error::new(
                Code::Internal,
                "the server ended the snapshot before its first chunk",
            )
        })?;
        Ok(SnapshotStream {
            stream,
            seq_no: first.seq_no,
            total_bytes: first.total_bytes,
            first: Some(first.data),
            received: 0,
        })
    }

    /// The snapshot holds exactly the collection's operations up to this sequence number.
    pub fn seq_no(&self) -> u64 {
        self.seq_no
    }

    /// The size of the whole snapshot file.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Bytes received so far.
    pub fn received_bytes(&self) -> u64 {
        self.received
    }

    /// The next bytes of the file; `None` once it is complete. A stream that ends early is an
    /// error (UNAVAILABLE if the connection broke, DATA_LOSS if the server ended it short).
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>> {
        let data = match self.first.take() {
            Some(data) => Some(data),
            None => self.stream.message().await?.map(|chunk| chunk.data),
        };
        match data {
            Some(data) => {
                self.received += data.len() as u64;
                if self.received > self.total_bytes {
                    return Err(Error::new(
                        Code::DataLoss,
                        format!(
                            "the snapshot is longer than the {} bytes announced",
                            self.total_bytes
                        ),
                    ));
                }
                Ok(Some(data))
            }
            None if self.received == self.total_bytes => Ok(None),
            None => Err(Error::new(
                Code::DataLoss,
                format!(
                    "the snapshot stream ended after {} of {} bytes",
                    self.received, self.total_bytes
                ),
            )),
        }
    }

    /// Copies the whole file to `writer` (and flushes it); returns the bytes written.
    pub async fn write_to(mut self, writer: &mut (impl AsyncWrite + Unpin)) -> Result<u64> {
        let io =
            |e: std::io::Error| Error::new(Code::Unknown, format!("writing the snapshot: {e}"));
        while let Some(chunk) = self.next_chunk().await? {
            writer.write_all(&chunk).await.map_err(io)?;
        }
        writer.flush().await.map_err(io)?;
        Ok(self.received)
    }
}

/// A restored collection ([`crate::Client::restore_snapshot`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Restored {
    /// The new collection as the server reports it.
    pub collection: CollectionInfo,
    /// The snapshot's sequence number; the collection's next write gets the one after it.
    pub seq_no: u64,
    /// Bytes of snapshot sent.
    pub bytes: u64,
}

/// Feeds `reader` into the request stream `tx` in chunks; the first message names the
/// collection. Returns the bytes sent, or the read error. Stops quietly when the call is over
/// (the receiver is gone: the server answered, usually with an error).
pub(crate) async fn feed_restore(
    collection: String,
    (shards, shard_key): (u32, i32),
    mut reader: impl AsyncRead + Unpin,
    tx: tokio::sync::mpsc::Sender<pb::RestoreSnapshotRequest>,
) -> std::io::Result<u64> {
    let mut collection = Some(collection);
    let mut sent = 0u64;
    loop {
        let mut data = vec![0u8; RESTORE_CHUNK_BYTES];
        let mut filled = 0;
        while filled < data.len() {
            let n = reader.read(&mut data[filled..]).await?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        data.truncate(filled);
        let last = filled < RESTORE_CHUNK_BYTES;
        if filled == 0 && collection.is_none() {
            return Ok(sent);
        }
        sent += filled as u64;
        let first = collection.is_some();
        let message = pb::RestoreSnapshotRequest {
            collection: collection.take().unwrap_or_default(),
            data,
            shards: if first { shards } else { 0 },
            shard_key: if first { shard_key } else { 0 },
        };
        if tx.send(message).await.is_err() || last {
            return Ok(sent);
        }
    }
}
