//! `tarn snapshot create|restore|verify`: backups of live collections to files on the client's
//! machine, restores into a running server (over gRPC) or offline into a stopped server's data
//! directory, and checking a file without restoring it.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use tarn_collection::{Collection, SnapshotInfo, SnapshotRestore};
use tokio::io::AsyncWriteExt;

use crate::cli::SnapshotCommand;
use crate::client::connect;

/// Bytes read from a snapshot file per write into an offline restore.
const READ_CHUNK_BYTES: usize = 1 << 20;

pub async fn run(command: SnapshotCommand) -> anyhow::Result<()> {
    match command {
        SnapshotCommand::Create {
            client,
            collection,
            out,
        } => create(&connect(&client).await?, &collection, &out).await,
        SnapshotCommand::Restore {
            client,
            input,
            collection,
            data_dir: None,
            shards,
            shard_key,
        } => {
            let started = Instant::now();
            let file = tokio::fs::File::open(&input)
                .await
                .with_context(|| format!("opening {}", input.display()))?;
            let restored = connect(&client)
                .await?
                .restore_snapshot_sharded(&collection, shards, shard_key.parse()?, file)
                .await?;
            let seconds = started.elapsed().as_secs_f64();
            println!(
                "restored {collection} at seq_no {}: {} documents; {} bytes in {seconds:.2} s \
                 ({:.1} MB/s)",
                restored.seq_no,
                restored.collection.n_documents,
                restored.bytes,
                restored.bytes as f64 / seconds / 1e6
            );
            Ok(())
        }
        SnapshotCommand::Restore {
            input,
            collection,
            data_dir: Some(data_dir),
            ..
        } => {
            let started = Instant::now();
            let (info, n_documents) = tokio::task::spawn_blocking(move || {
                restore_offline(&input, &data_dir, &collection)
            })
            .await??;
            let seconds = started.elapsed().as_secs_f64();
            println!(
                "restored offline at seq_no {}: {n_documents} documents; {} bytes in {seconds:.2} \
                 s ({:.1} MB/s)",
                info.seq_no,
                info.n_bytes,
                info.n_bytes as f64 / seconds / 1e6
            );
            Ok(())
        }
        SnapshotCommand::Verify { input } => {
            let info = tokio::task::spawn_blocking(move || -> anyhow::Result<SnapshotInfo> {
                let file = std::fs::File::open(&input)
                    .with_context(|| format!("opening {}", input.display()))?;
                tarn_collection::verify_snapshot(std::io::BufReader::new(file))
                    .with_context(|| format!("{} is not a valid snapshot", input.display()))
            })
            .await??;
            println!(
                "valid snapshot (format {}): seq_no {}, checkpoint {}, dimension {}, metric {:?}; \
                 {} segments, {} tombstone files, {} log entries; {} bytes",
                info.format_version,
                info.seq_no,
                info.checkpoint_seq,
                info.config.dimension,
                info.config.metric,
                info.n_segments,
                info.n_tombstone_files,
                info.n_wal_entries,
                info.n_bytes
            );
            Ok(())
        }
    }
}

/// Streams a snapshot into `<out>.partial`, syncs it, and renames it to `out`: a file at `out`
/// is always a whole snapshot.
async fn create(client: &tarn_client::Client, collection: &str, out: &Path) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut stream = client.create_snapshot(collection).await?;
    let (seq_no, total_bytes) = (stream.seq_no(), stream.total_bytes());
    let mut partial_name = out.as_os_str().to_owned();
    partial_name.push(".partial");
    let partial = PathBuf::from(partial_name);
    let mut file = tokio::fs::File::create(&partial)
        .await
        .with_context(|| format!("creating {}", partial.display()))?;
    let progress = indicatif::ProgressBar::new(total_bytes);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let written = async {
        while let Some(chunk) = stream.next_chunk().await? {
            file.write_all(&chunk).await?;
            progress.inc(chunk.len() as u64);
        }
        file.sync_all().await?;
        anyhow::Ok(())
    }
    .await;
    progress.finish_and_clear();
    if let Err(error) = written {
        let _ = tokio::fs::remove_file(&partial).await;
        return Err(error.context(format!("snapshot of {collection} failed")));
    }
    tokio::fs::rename(&partial, out)
        .await
        .with_context(|| format!("renaming {} to {}", partial.display(), out.display()))?;
    let parent = match out.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
        _ => PathBuf::from("."),
    };
    tokio::fs::File::open(&parent).await?.sync_all().await?;
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "snapshot of {collection} at seq_no {seq_no}: {total_bytes} bytes in {seconds:.2} s \
         ({:.1} MB/s) -> {}",
        total_bytes as f64 / seconds / 1e6,
        out.display()
    );
    Ok(())
}

/// Restores `input` as collection `name` in a stopped server's `data_dir` (its lock is taken,
/// so a running server is refused), then opens it once to prove it serves. Returns the
/// snapshot's description and the collection's live documents.
fn restore_offline(
    input: &Path,
    data_dir: &Path,
    name: &str,
) -> anyhow::Result<(SnapshotInfo, u64)> {
    tarn_dataplane::validate_name(name).map_err(|e| anyhow::anyhow!("{e}"))?;
    let _lock = tarn_server::lock_data_dir(data_dir)?;
    let collections = data_dir.join("collections");
    std::fs::create_dir_all(&collections)
        .with_context(|| format!("creating {}", collections.display()))?;
    tarn_collection::remove_interrupted_restores(&collections)?;
    let target = collections.join(name);
    if target.exists() {
        bail!("collection {name} already exists in {}", data_dir.display());
    }
    let mut file =
        std::fs::File::open(input).with_context(|| format!("opening {}", input.display()))?;
    let mut restore = SnapshotRestore::begin(&target)?;
    let mut buffer = vec![0u8; READ_CHUNK_BYTES];
    loop {
        let n = match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", input.display())),
        };
        restore
            .write(&buffer[..n])
            .with_context(|| format!("{} is not a valid snapshot", input.display()))?;
    }
    let info = restore
        .finish()
        .with_context(|| format!("{} is not a valid snapshot", input.display()))?;
    let collection = Collection::open(&target)
        .with_context(|| format!("opening the restored collection {name}"))?;
    let n_documents = collection.stats().n_documents;
    collection.close();
    Ok((info, n_documents))
}
