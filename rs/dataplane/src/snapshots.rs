//! Snapshots over gRPC: `CreateSnapshot` streams a live collection's snapshot from a thread of
//! its own, `RestoreSnapshot` feeds the uploaded bytes to a restore on a thread of its own, and
//! the registry adopts the restored collection only once it is complete and verified.
//!
//! The snapshot and restore threads do the blocking file I/O (reads, writes, fsyncs); runtime
//! workers only move chunks between them and the gRPC stream, through bounded channels (a slow
//! client holds back the reads, a slow disk holds back the upload). At most
//! [`MAX_CONCURRENT_SNAPSHOTS`] of each run at once; more get RESOURCE_EXHAUSTED.

use std::io::Read;
use std::sync::Arc;

use tarn_collection::{Collection, SnapshotInfo, SnapshotRestore};
use tarn_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};
use tonic::Status;

use crate::registry::Registry;
use crate::status::ApiError;

/// Snapshots (and, separately, restores) running at once on one server.
pub const MAX_CONCURRENT_SNAPSHOTS: usize = 4;
/// Bytes per `SnapshotChunk` message.
const CHUNK_BYTES: usize = 1 << 20;
/// Chunks buffered between a snapshot or restore thread and the gRPC stream.
const CHANNEL_CHUNKS: usize = 4;

/// The stream `CreateSnapshot` answers with.
pub type ChunkStream = tokio_stream::wrappers::ReceiverStream<Result<pb::SnapshotChunk, Status>>;

/// Starts a snapshot of `collection` (the sync barrier and file pins, on a blocking thread) and
/// returns the stream of its chunks, read by a thread of its own. The snapshot's pins are
/// released when the thread ends: at the end of the file, or as soon as the client goes away.
pub async fn stream_snapshot(
    name: String,
    collection: Collection,
    permit: OwnedSemaphorePermit,
) -> Result<ChunkStream, ApiError> {
    let started = {
        let name = name.clone();
        tokio::task::spawn_blocking(move || {
            collection.snapshot().map_err(|e| {
                tracing::warn!(collection = %name, error = %e, "snapshot failed to start");
                ApiError::from(e)
            })
        })
    };
    let snapshot = started
        .await
        .map_err(|e| ApiError::Internal(format!("snapshot start: {e}")))??;
    let (seq_no, total_bytes) = (snapshot.seq_no(), snapshot.total_bytes());
    tracing::info!(collection = %name, seq_no, total_bytes, "snapshot started");
    let (tx, rx) = mpsc::channel(CHANNEL_CHUNKS);
    std::thread::Builder::new()
        .name(format!("tarn-snapshot-{name}"))
        .spawn(move || {
            let _permit = permit;
            let mut snapshot = snapshot;
            let mut sent = 0u64;
            loop {
                let mut data = vec![0u8; CHUNK_BYTES];
                let mut filled = 0;
                let read = loop {
                    match snapshot.read(&mut data[filled..]) {
                        Ok(0) => break Ok(()),
                        Ok(n) => {
                            filled += n;
                            if filled == data.len() {
                                break Ok(());
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => break Err(e),
                    }
                };
                if let Err(error) = read {
                    tracing::error!(collection = %name, %error, "snapshot read failed");
                    let _ = tx.blocking_send(Err(Status::internal(format!(
                        "snapshot of collection '{name}' failed while reading its files"
                    ))));
                    return;
                }
                data.truncate(filled);
                let done = filled == 0;
                // The first message goes out even if empty: it carries seq_no and total_bytes.
                if done && sent > 0 {
                    tracing::info!(collection = %name, seq_no, bytes = sent, "snapshot sent");
                    return;
                }
                sent += filled as u64;
                let chunk = pb::SnapshotChunk {
                    data,
                    seq_no,
                    total_bytes,
                };
                if tx.blocking_send(Ok(chunk)).is_err() {
                    tracing::info!(collection = %name, seq_no, bytes = sent, "snapshot abandoned by the client");
                    return;
                }
                if done {
                    return;
                }
            }
        })
        .map_err(|e| ApiError::Internal(format!("cannot start a snapshot thread: {e}")))?;
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// A restore in progress: a thread owns the [`SnapshotRestore`] and writes what
/// [`RestoreUpload::push`] hands it; [`RestoreUpload::finish`] gives it back, complete or not.
pub struct RestoreUpload {
    tx: Option<mpsc::Sender<Vec<u8>>>,
    done: oneshot::Receiver<tarn_collection::Result<SnapshotRestore>>,
}

impl RestoreUpload {
    /// Begins a restore into `target` (which must not exist) on a thread of its own.
    pub fn begin(name: &str, target: std::path::PathBuf) -> Result<RestoreUpload, ApiError> {
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(CHANNEL_CHUNKS);
        let (done_tx, done) = oneshot::channel();
        std::thread::Builder::new()
            .name(format!("tarn-restore-{name}"))
            .spawn(move || {
                let result = (|| {
                    let mut restore = SnapshotRestore::begin(&target)?;
                    while let Some(bytes) = rx.blocking_recv() {
                        restore.write(&bytes)?;
                    }
                    Ok(restore)
                })();
                // A failed restore drops here, removing its staging directory, before the
                // handler hears of it.
                let _ = done_tx.send(result);
            })
            .map_err(|e| ApiError::Internal(format!("cannot start a restore thread: {e}")))?;
        Ok(RestoreUpload { tx: Some(tx), done })
    }

    /// Hands the next bytes to the restore thread. `false` once that thread has stopped (the
    /// file is damaged): [`RestoreUpload::finish`] says why.
    pub async fn push(&mut self, bytes: Vec<u8>) -> bool {
        match &self.tx {
            Some(tx) => tx.send(bytes).await.is_ok(),
            None => false,
        }
    }

    /// Ends the upload and returns the restore, every byte written (not yet finished).
    pub async fn finish(mut self) -> Result<SnapshotRestore, ApiError> {
        self.tx = None;
        let restore = self
            .done
            .await
            .map_err(|_| ApiError::Internal("the restore thread died".to_owned()))?;
        Ok(restore?)
    }
}

/// The first message of a `RestoreSnapshot` upload (it names the collection).
pub async fn first_message(
    stream: &mut tonic::Streaming<pb::RestoreSnapshotRequest>,
) -> Result<pb::RestoreSnapshotRequest, ApiError> {
    stream
        .message()
        .await
        .map_err(|s| ApiError::Aborted(format!("restore upload failed: {}", s.message())))?
        .ok_or_else(|| {
            ApiError::invalid(
                "collection",
                "the restore stream is empty; its first message must name the new collection",
            )
        })
}

/// Receives a `RestoreSnapshot` upload and adopts the restored collection.
pub async fn restore_from_stream(
    registry: &Arc<Registry>,
    mut stream: tonic::Streaming<pb::RestoreSnapshotRequest>,
) -> Result<(String, Collection, SnapshotInfo), ApiError> {
    let first = first_message(&mut stream).await?;
    let name = first.collection;
    let target = registry.restore_target(&name)?;
    let restore = receive(&name, target, first.data, stream).await?;
    let (collection, info) = registry.adopt_restore(&name, restore).await?;
    tracing::info!(collection = %name, seq_no = info.seq_no, "snapshot restored");
    Ok((name, collection, info))
}

/// Writes the upload (`first_data`, then the rest of `stream`) into a restore at `target` and
/// returns it complete but not finished.
pub async fn receive(
    name: &str,
    target: std::path::PathBuf,
    first_data: Vec<u8>,
    mut stream: tonic::Streaming<pb::RestoreSnapshotRequest>,
) -> Result<SnapshotRestore, ApiError> {
    let mut upload = RestoreUpload::begin(name, target)?;
    let mut next = Some(first_data);
    let mut n_bytes = 0u64;
    loop {
        if let Some(data) = next.take() {
            n_bytes += data.len() as u64;
            if !data.is_empty() && !upload.push(data).await {
                break; // the restore thread refused the bytes: finish() has the error
            }
        }
        match stream.message().await {
            Ok(Some(message)) => {
                if !message.collection.is_empty() && message.collection != *name {
                    return Err(ApiError::invalid(
                        "collection",
                        format!(
                            "a restore names one collection: {:?} after {name:?}",
                            message.collection
                        ),
                    ));
                }
                next = Some(message.data);
            }
            Ok(None) => break,
            // The client went away or the connection broke: the restore is dropped (its
            // staging directory removed) and nothing appears.
            Err(status) => {
                tracing::warn!(collection = %name, n_bytes, "restore upload interrupted");
                return Err(ApiError::Aborted(format!(
                    "restore of collection '{name}' interrupted after {n_bytes} bytes: {}",
                    status.message()
                )));
            }
        }
    }
    let restore = upload.finish().await?;
    tracing::info!(collection = %name, n_bytes, "snapshot received");
    Ok(restore)
}
