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

    /// The local collection of a cluster shard (`<collection>.<uid>.<shard>`), created with
    /// `config` if this node has none yet (the shard was just assigned to it).
    pub async fn shard(
        &self,
        local_name: &str,
        config: impl FnOnce() -> Result<CollectionConfig, ApiError>,
    ) -> Result<Collection, ApiError> {
        if let Some(collection) = self.collections.get(local_name) {
            return Ok(collection.clone());
        }
        let config = config()?;
        let _admin = self.admin.lock().await;
        if let Some(collection) = self.collections.get(local_name) {
            return Ok(collection.clone());
        }
        let path = self.root.join(local_name);
        let collection = tokio::task::spawn_blocking(move || Collection::create(&path, config))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))??;
        tracing::info!(shard = %local_name, "created a local shard");
        self.collections
            .insert(local_name.to_owned(), collection.clone());
        Ok(collection)
    }

    /// Drops a local shard collection (its collection was dropped from the cluster).
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

    /// Where a shard move restores its copy of the local shard `local_name` (which this node
    /// must not hold).
    pub fn shard_restore_target(&self, local_name: &str) -> Result<PathBuf, ApiError> {
        if tarn_cluster::ShardName::parse(local_name).is_none() {
            return Err(ApiError::invalid(
                "shard",
                format!("{local_name:?} is not a shard"),
            ));
        }
        if self.collections.contains_key(local_name) {
            return Err(ApiError::AlreadyExists(local_name.to_owned()));
        }
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

/// Deletes `root/name` after renaming it aside (`.drop-<name>-<nanos>`, finished at the next
/// open if a crash interrupts the delete), so a half-deleted collection is never opened.
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
