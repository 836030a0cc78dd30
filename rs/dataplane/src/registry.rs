//! The collections of a data directory: `<data_dir>/collections/<name>/`, opened at start.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dashmap::DashMap;
use tarn_collection::{Collection, CollectionConfig, SnapshotInfo, SnapshotRestore};

use crate::status::ApiError;

/// Directories of cluster imports' temporary copies start with this.
const IMPORT_PREFIX: &str = ".import-";

/// Collection names: `[A-Za-z0-9_-]{1,64}`, so a name is never a path.
pub fn validate_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "name",
            format!("{name:?} must match [A-Za-z0-9_-]{{1,64}}"),
        ))
    }
}

#[derive(Debug)]
pub struct Registry {
    root: PathBuf,
    collections: DashMap<String, Collection>,
    /// Serialises create and drop (rare) so that a name is never half made.
    admin: tokio::sync::Mutex<()>,
}

impl Registry {
    /// Opens every collection under `data_dir/collections` (blocking).
    pub fn open(data_dir: &Path) -> anyhow::Result<Registry> {
        let root = data_dir.join("collections");
        std::fs::create_dir_all(&root)?;
        // Restores killed before their collection appeared left only a staging directory.
        let n_interrupted = tarn_collection::remove_interrupted_restores(&root)
            .map_err(|e| anyhow::anyhow!("cleaning up interrupted restores: {e}"))?;
        if n_interrupted > 0 {
            tracing::warn!(
                n_interrupted,
                "removed the staging directories of interrupted restores"
            );
        }
        let collections = DashMap::new();
        for entry in std::fs::read_dir(&root)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !entry.file_type()?.is_dir() {
                // The LOCK file, a volume's placeholder: collections are directories.
                continue;
            }
            if name.starts_with(".drop-") || name.starts_with(IMPORT_PREFIX) {
                // A drop interrupted after its rename, or an import's temporary copy of a
                // snapshot (cluster mode): finish the drop / discard the copy.
                std::fs::remove_dir_all(entry.path())?;
                continue;
            }
            let is_shard = tarn_cluster::ShardName::parse(&name)
                .is_some_and(|(n, epoch)| epoch.is_none() && validate_name(&n.collection).is_ok());
            if (validate_name(&name).is_err() && !is_shard)
                || !entry.path().join("collection.json").exists()
            {
                tracing::warn!(path = %entry.path().display(), "ignoring a directory that is not a collection");
                continue;
            }
            let collection = Collection::open(&entry.path())
                .map_err(|e| anyhow::anyhow!("cannot open collection {name}: {e}"))?;
            tracing::info!(%name, "opened collection");
            collections.insert(name, collection);
        }
        // A set-aside copy's drop interrupted after its rename.
        if let Ok(entries) = std::fs::read_dir(data_dir.join("set-aside")) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with(".drop-") {
                    std::fs::remove_dir_all(entry.path())?;
                }
            }
        }
        Ok(Registry {
            root,
            collections,
            admin: tokio::sync::Mutex::new(()),
        })
    }

    pub fn get(&self, name: &str) -> Result<Collection, ApiError> {
        validate_name(name)?;
        self.collections
            .get(name)
            .map(|c| c.clone())
            .ok_or_else(|| ApiError::NotFound(name.to_owned()))
    }

    /// The local collection of a cluster shard (`<collection>.<uid>.<shard>`), if this node
    /// holds one.
    pub fn get_shard(&self, local_name: &str) -> Result<Collection, ApiError> {
        self.collections
            .get(local_name)
            .map(|c| c.clone())
            .ok_or_else(|| ApiError::NotFound(local_name.to_owned()))
    }

    /// Creates the local collection of a cluster shard, empty, with `config` (the map says this
    /// data directory starts it); the existing one if it is already there.
    pub async fn create_shard(
        &self,
        local_name: &str,
        config: CollectionConfig,
    ) -> Result<Collection, ApiError> {
        let _admin = self.admin.lock().await;
        if let Some(collection) = self.collections.get(local_name) {
            return Ok(collection.clone());
        }
        self.set_aside_unlisted(local_name).await?;
        let path = self.root.join(local_name);
        let collection = tokio::task::spawn_blocking(move || Collection::create(&path, config))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))??;
        tracing::info!(shard = %local_name, "created a local shard");
        self.collections
            .insert(local_name.to_owned(), collection.clone());
        Ok(collection)
    }

    /// Drops a local shard collection (its collection was dropped from the cluster, or another
    /// node holds its data).
    pub async fn drop_shard(&self, local_name: &str) -> Result<(), ApiError> {
        let _admin = self.admin.lock().await;
        let Some((_, collection)) = self.collections.remove(local_name) else {
            return Ok(());
        };
        let (root, name) = (self.root.clone(), local_name.to_owned());
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            collection.close();
            remove_aside(&root, &name)
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(|e| ApiError::Internal(format!("dropping shard {local_name}: {e}")))
    }

    /// Cuts a local shard's log after entry `keep` (a replica holding entries a deposed primary
    /// never had acknowledged, `tarn_collection::cut_log_after`): closes the copy, cuts, and
    /// opens it again (recovery replays the log up to `keep`). A cut a checkpoint forbids
    /// changes nothing (the copy is opened again as it was) and is an error. Returns the
    /// reopened copy and how many entries were cut. The caller holds the copy's lock.
    pub async fn cut_shard_log(
        &self,
        local_name: &str,
        keep: u64,
    ) -> Result<(Collection, u64), ApiError> {
        let _admin = self.admin.lock().await;
        let Some((_, collection)) = self.collections.remove(local_name) else {
            return Err(ApiError::NotFound(local_name.to_owned()));
        };
        let path = self.root.join(local_name);
        let (reopened, cut) = tokio::task::spawn_blocking(move || {
            collection.close();
            drop(collection);
            let cut = tarn_collection::cut_log_after(&path, keep);
            (Collection::open(&path), cut)
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
        let reopened = reopened?;
        self.collections
            .insert(local_name.to_owned(), reopened.clone());
        match cut {
            Ok(n) => {
                tracing::warn!(shard = %local_name, keep, cut = n, "cut entries a deposed primary never had acknowledged off this copy's log");
                Ok((reopened, n))
            }
            Err(error) => Err(ApiError::Unavailable(format!(
                "shard copy {local_name} cannot cut its log after {keep}: {error}"
            ))),
        }
    }

    /// The directory of set-aside shard copies: `<data_dir>/set-aside/`.
    pub fn set_aside_dir(&self) -> PathBuf {
        self.root
            .parent()
            .map_or_else(|| self.root.join("..set-aside"), |d| d.join("set-aside"))
    }

    /// Takes a local shard out of service without deleting it: closed, and moved (one rename,
    /// then both directories synced) to `set-aside/<local name>-<unix seconds>`, with the
    /// reason beside it in `<that>.why`. Returns the new path.
    pub async fn set_aside(&self, local_name: &str, why: &str) -> Result<PathBuf, ApiError> {
        let _admin = self.admin.lock().await;
        let Some((_, collection)) = self.collections.remove(local_name) else {
            return Err(ApiError::NotFound(local_name.to_owned()));
        };
        let (root, aside_root) = (self.root.clone(), self.set_aside_dir());
        let name = local_name.to_owned();
        let why = why.to_owned();
        tokio::task::spawn_blocking(move || {
            collection.close();
            move_aside(&root, &aside_root, &name, &why)
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(|e| ApiError::Internal(format!("setting shard {local_name} aside: {e}")))
    }

    /// Sets aside a directory `collections/<local_name>` that holds a copy this registry does
    /// not list (left by a process that stopped between writing a copy and listing it): a new
    /// copy of the shard is about to take its place, and a copy is never deleted on a guess.
    /// Logged as an error with the path it went to. The caller holds `admin`.
    async fn set_aside_unlisted(&self, local_name: &str) -> Result<(), ApiError> {
        let path = self.root.join(local_name);
        if self.collections.contains_key(local_name) || !path.exists() {
            return Ok(());
        }
        let (root, aside_root) = (self.root.clone(), self.set_aside_dir());
        let name = local_name.to_owned();
        let target = tokio::task::spawn_blocking(move || {
            move_aside(
                &root,
                &aside_root,
                &name,
                "found in collections/ without being listed by the running node when a new \
                 copy of the shard was about to be made there",
            )
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(|e| {
            ApiError::Internal(format!(
                "setting aside an unlisted copy of {local_name}: {e}"
            ))
        })?;
        tracing::error!(shard = %local_name, path = %target.display(),
            "a copy of this shard was on disk without being listed: set aside before a new one is made");
        Ok(())
    }

    /// Whether a copy of the local shard `local_name` was ever set aside here (still listed);
    /// `true` when the list cannot be read.
    pub fn has_set_aside(&self, local_name: &str) -> bool {
        let prefix = format!("{local_name}-");
        self.set_aside_list().map_or(true, |list| {
            list.iter().any(|(name, _, _)| name.starts_with(&prefix))
        })
    }

    /// The set-aside copies: (entry name, the reason, bytes on disk), by name.
    pub fn set_aside_list(&self) -> Result<Vec<(String, String, u64)>, ApiError> {
        let dir = self.set_aside_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(ApiError::Internal(format!("listing set-aside shards: {e}"))),
        };
        let mut list = Vec::new();
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let why = std::fs::read_to_string(why_path(&entry.path()))
                .unwrap_or_default()
                .trim()
                .to_owned();
            list.push((name, why, dir_bytes(&entry.path())));
        }
        list.sort();
        Ok(list)
    }

    /// The path of the set-aside copy `name` (as listed); NOT_FOUND if there is none.
    pub fn set_aside_path(&self, name: &str) -> Result<PathBuf, ApiError> {
        let valid = !name.is_empty()
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
        if !valid {
            return Err(ApiError::invalid(
                "name",
                format!("{name:?} is not a set-aside shard's name"),
            ));
        }
        let path = self.set_aside_dir().join(name);
        if !path.is_dir() {
            return Err(ApiError::NotFound(format!("set-aside shard {name}")));
        }
        Ok(path)
    }

    /// Deletes the set-aside copy `name` for good.
    pub async fn drop_set_aside(&self, name: &str) -> Result<(), ApiError> {
        let path = self.set_aside_path(name)?;
        let _admin = self.admin.lock().await;
        let dir = self.set_aside_dir();
        let name = name.to_owned();
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            remove_aside(&dir, &name)?;
            match std::fs::remove_file(why_path(&path)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(|e| ApiError::Internal(format!("dropping a set-aside shard: {e}")))
    }

    /// The local cluster shards (`<collection>.<uid>.<shard>`).
    pub fn shard_names(&self) -> Vec<String> {
        self.collections
            .iter()
            .map(|e| e.key().clone())
            .filter(|name| validate_name(name).is_err())
            .collect()
    }

    /// User collections (not cluster shards), sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .collections
            .iter()
            .map(|e| e.key().clone())
            .filter(|name| validate_name(name).is_ok())
            .collect();
        names.sort();
        names
    }

    pub fn all(&self) -> Vec<(String, Collection)> {
        self.collections
            .iter()
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect()
    }

    pub async fn create(
        self: &Arc<Self>,
        name: &str,
        config: CollectionConfig,
    ) -> Result<Collection, ApiError> {
        validate_name(name)?;
        let _admin = self.admin.lock().await;
        if self.collections.contains_key(name) {
            return Err(ApiError::AlreadyExists(name.to_owned()));
        }
        let path = self.root.join(name);
        let collection = tokio::task::spawn_blocking(move || Collection::create(&path, config))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))??;
        self.collections.insert(name.to_owned(), collection.clone());
        Ok(collection)
    }

    /// Closes the collection (in-flight writes fail with UNAVAILABLE) and deletes its files:
    /// renamed aside first, so a crash mid-delete never leaves a half-deleted collection behind.
    pub async fn drop_collection(&self, name: &str) -> Result<(), ApiError> {
        validate_name(name)?;
        let _admin = self.admin.lock().await;
        let Some((_, collection)) = self.collections.remove(name) else {
            return Err(ApiError::NotFound(name.to_owned()));
        };
        let (root, name) = (self.root.clone(), name.to_owned());
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            collection.close();
            remove_aside(&root, &name)
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(|e| ApiError::Internal(format!("dropping {}: {e}", self.root.display())))
    }

    /// Where a restore of `name` writes its collection; ALREADY_EXISTS if the name is taken
    /// (checked again when the restore is adopted).
    pub fn restore_target(&self, name: &str) -> Result<PathBuf, ApiError> {
        validate_name(name)?;
        if self.collections.contains_key(name) {
            return Err(ApiError::AlreadyExists(name.to_owned()));
        }
        Ok(self.root.join(name))
    }

    /// Where a shard move or seed restores its copy of the local shard `local_name` (which this
    /// node must not hold; an unlisted copy in the way is set aside first).
    pub async fn shard_restore_target(&self, local_name: &str) -> Result<PathBuf, ApiError> {
        if tarn_cluster::ShardName::parse(local_name).is_none() {
            return Err(ApiError::invalid(
                "shard",
                format!("{local_name:?} is not a shard"),
            ));
        }
        let _admin = self.admin.lock().await;
        if self.collections.contains_key(local_name) {
            return Err(ApiError::AlreadyExists(local_name.to_owned()));
        }
        self.set_aside_unlisted(local_name).await?;
        Ok(self.root.join(local_name))
    }

    /// A fresh hidden directory for a cluster import's temporary copy of a snapshot; one left
    /// by a crash is deleted at the next start.
    pub fn import_dir(&self, name: &str) -> Result<PathBuf, ApiError> {
        validate_name(name)?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Ok(self.root.join(format!("{IMPORT_PREFIX}{name}-{nanos}")))
    }

    /// Makes a fully written restore the collection `name`: under the create/drop lock, checks
    /// that the name is still free, verifies and renames it into place
    /// ([`SnapshotRestore::finish`]), opens it and serves it. On any failure nothing appears
    /// (a collection that fails to open after the rename is moved aside and deleted).
    pub async fn adopt_restore(
        &self,
        name: &str,
        restore: SnapshotRestore,
    ) -> Result<(Collection, SnapshotInfo), ApiError> {
        let _admin = self.admin.lock().await;
        if self.collections.contains_key(name) {
            return Err(ApiError::AlreadyExists(name.to_owned()));
        }
        let (root, owned_name) = (self.root.clone(), name.to_owned());
        let (collection, info) = tokio::task::spawn_blocking(move || {
            let info = restore.finish()?;
            let path = root.join(&owned_name);
            match Collection::open(&path) {
                Ok(collection) => Ok((collection, info)),
                Err(error) => {
                    tracing::error!(collection = %owned_name, %error, "a verified restore failed to open; removing it");
                    if let Err(e) = remove_aside(&root, &owned_name) {
                        tracing::error!(collection = %owned_name, error = %e, "could not remove the failed restore");
                    }
                    Err(error)
                }
            }
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
        self.collections.insert(name.to_owned(), collection.clone());
        Ok((collection, info))
    }

    /// Closes every collection: ingestion finishes, WALs are synced.
    pub fn close_all(&self) {
        for (name, collection) in self.all() {
            collection.close();
            tracing::info!(%name, "closed collection");
        }
    }
}

/// Where the reason of the set-aside copy at `path` is written: `<path>.why`.
fn why_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".why");
    PathBuf::from(name)
}

/// The bytes of the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

/// Deletes `root/name` after renaming it aside (`.drop-<name>-<nanos>`, finished at the next
/// open if a crash interrupts the delete), so a half-deleted collection is never opened.
/// Moves `root/<name>` (closed) to `aside_root/<name>-<unix seconds>` in one rename, with
/// `why` beside it in `<that>.why`, and syncs both directories. Returns the new path.
fn move_aside(root: &Path, aside_root: &Path, name: &str, why: &str) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(aside_root)?;
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut target = aside_root.join(format!("{name}-{secs}"));
    let mut n = 1;
    while target.exists() {
        target = aside_root.join(format!("{name}-{secs}-{n}"));
        n += 1;
    }
    let reason = why_path(&target);
    std::fs::write(&reason, format!("{why}\n"))?;
    std::fs::File::open(&reason)?.sync_all()?;
    std::fs::rename(root.join(name), &target)?;
    std::fs::File::open(aside_root)?.sync_all()?;
    std::fs::File::open(root)?.sync_all()?;
    Ok(target)
}

fn remove_aside(root: &Path, name: &str) -> std::io::Result<()> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let aside = root.join(format!(".drop-{name}-{nanos}"));
    std::fs::rename(root.join(name), &aside)?;
    std::fs::File::open(root)?.sync_all()?;
    std::fs::remove_dir_all(&aside)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy on disk that the registry does not list (a process stopped between writing it
    /// and listing it) never blocks the shard for good: a new copy or a seed's restore sets it
    /// aside, with the reason, and goes on. Before, every try failed with "a collection already
    /// exists" (the nemesis's seed 158: a replica never caught up).
    #[test]
    fn an_unlisted_copy_in_the_way_is_set_aside_not_an_error_forever() {
        let dir = tempfile::tempdir().unwrap();
        let registry = Registry::open(dir.path()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let config = CollectionConfig::new(4, tarn_collection::MetricName::L2);
        let name = tarn_cluster::ShardName {
            collection: "docs".to_owned(),
            uid: 7,
            shard: 2,
        };
        let local = &name.local_name();
        let orphan =
            Collection::create(&dir.path().join("collections").join(local), config.clone())
                .unwrap();
        orphan.close();
        drop(orphan);
        let created = rt.block_on(registry.create_shard(local, config.clone()));
        assert!(created.is_ok(), "{created:?}");
        let aside = registry.set_aside_list().unwrap();
        assert_eq!(aside.len(), 1, "{aside:?}");
        assert!(aside[0].0.starts_with(local), "{aside:?}");
        assert!(aside[0].1.contains("without being listed"), "{aside:?}");
        // The same for a restore's target.
        rt.block_on(registry.drop_shard(local)).unwrap();
        let orphan =
            Collection::create(&dir.path().join("collections").join(local), config).unwrap();
        orphan.close();
        drop(orphan);
        let target = rt.block_on(registry.shard_restore_target(local)).unwrap();
        assert!(!target.exists());
        assert_eq!(registry.set_aside_list().unwrap().len(), 2);
    }

    #[test]
    fn names_are_never_paths() {
        for good in ["a", "docs_2024", "A-b_C", &"x".repeat(64)] {
            assert!(validate_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "../x",
            "a/b",
            ".",
            "..",
            "a b",
            "é",
            &"x".repeat(65),
            "a\0b",
        ] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }
}
