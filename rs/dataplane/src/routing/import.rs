//! Imports into a cluster collection: a single node's snapshot, or a copy set aside on this
//! node, inserted document by document through the router.

use super::*;

/// Documents per insert when an import copies a snapshot into a cluster collection.
const IMPORT_BATCH: usize = 500;

impl Router {
    /// `RestoreSnapshot` in cluster mode: the way a collection that started on one node moves
    /// into a cluster. The snapshot is restored into a hidden local copy (verified as any
    /// restore), a sharded collection is created with its configuration, every live document is
    /// inserted through the router (FSYNC, batches of one tenant), and the copy is deleted. The
    /// collection exists while it fills; if the import fails it is dropped again.
    pub async fn import_snapshot(
        &self,
        cluster: &ClusterNode,
        mut stream: tonic::Streaming<pb::RestoreSnapshotRequest>,
        api_key: Option<&str>,
    ) -> Result<(pb::CollectionInfo, u64), ApiError> {
        let first = crate::snapshots::first_message(&mut stream).await?;
        let name = first.collection.clone();
        crate::registry::validate_name(&name)?;
        if cluster.state().collections.contains_key(&name) {
            return Err(ApiError::AlreadyExists(name));
        }
        let dir = self.registry.import_dir(&name)?;
        let restore = crate::snapshots::receive(&name, dir.clone(), first.data, stream).await?;
        let opened = tokio::task::spawn_blocking({
            let dir = dir.clone();
            move || -> Result<_, ApiError> {
                let info = restore.finish()?;
                let copy = tarn_collection::Collection::open(&dir)?;
                Ok((copy, info))
            }
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
        let (copy, info) = match opened {
            Ok(opened) => opened,
            Err(error) => {
                remove_import_dir(dir).await;
                return Err(error);
            }
        };
        let request = pb::CreateCollectionRequest {
            name: name.clone(),
            shards: first.shards,
            shard_key: first.shard_key,
            ..Default::default()
        };
        let created = cluster
            .create_collection(&request, info.config.clone())
            .await;
        let copied = match &created {
            Ok(_) => self.copy_into(cluster, &name, &copy, api_key).await,
            Err(_) => Ok(0),
        };
        copy.close();
        remove_import_dir(dir).await;
        let map = created?;
        let n_copied = match copied {
            Ok(n) => n,
            Err(error) => {
                tracing::error!(collection = %name, %error, "import failed; dropping the collection");
                if let Err(drop_error) = cluster.drop_collection(&name).await {
                    tracing::error!(collection = %name, error = %drop_error, "could not drop the failed import");
                }
                return Err(error);
            }
        };
        tracing::info!(collection = %name, n_copied, seq_no = info.seq_no, "snapshot imported into the cluster");
        Ok((
            self.routed_info(cluster, &map, api_key, None).await?,
            info.seq_no,
        ))
    }

    /// `Cluster/ImportSetAside`: every live document of the set-aside copy `name` inserted
    /// into the existing cluster collection `collection` through the router (a shard's data
    /// goes back wherever its shard is now). The copy is opened in place and stays until dropped.
    pub async fn import_set_aside(
        &self,
        cluster: &ClusterNode,
        name: &str,
        collection: &str,
        api_key: Option<&str>,
    ) -> Result<u64, ApiError> {
        let map = cluster.map(collection).await?;
        let path = self.registry.set_aside_path(name)?;
        // Imported whole: its log past its checkpoint too (entries it held uncommitted).
        let copy =
            tokio::task::spawn_blocking(move || tarn_collection::Collection::open_whole(&path))
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))??;
        let config: tarn_collection::CollectionConfig =
            serde_json::from_value(map.def.config.clone())
                .map_err(|e| ApiError::Internal(format!("bad collection config: {e}")))?;
        if copy.config().dimension != config.dimension {
            copy.close();
            return Err(ApiError::invalid(
                "collection",
                format!(
                    "'{collection}' holds {}-d vectors but the set-aside copy {}-d",
                    config.dimension,
                    copy.config().dimension
                ),
            ));
        }
        let copied = self.copy_into(cluster, collection, &copy, api_key).await;
        copy.close();
        let n = copied?;
        tracing::info!(set_aside = %name, %collection, n, "set-aside shard copy imported");
        Ok(n)
    }

    /// Inserts every live document of `copy` into the cluster collection `name`; returns how
    /// many. A blocking thread reads the copy; batches go through a small bounded channel.
    async fn copy_into(
        &self,
        cluster: &ClusterNode,
        name: &str,
        copy: &tarn_collection::Collection,
        api_key: Option<&str>,
    ) -> Result<u64, ApiError> {
        type Batch = (u128, Vec<u128>, Vec<f32>, Vec<pb::Attributes>);
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Batch>(4);
        let reader = {
            let copy = copy.clone();
            tokio::task::spawn_blocking(move || -> Result<(), ApiError> {
                let mut batch: Option<Batch> = None;
                for document in copy.export_documents_with_attributes() {
                    let (user, doc, vector, attributes) = document?;
                    if batch
                        .as_ref()
                        .is_some_and(|b| b.0 != user || b.1.len() >= IMPORT_BATCH)
                    {
                        if let Some(full) = batch.take() {
                            if tx.blocking_send(full).is_err() {
                                return Ok(());
                            }
                        }
                    }
                    let entry =
                        batch.get_or_insert_with(|| (user, Vec::new(), Vec::new(), Vec::new()));
                    entry.1.push(doc);
                    entry.2.extend_from_slice(&vector);
                    entry
                        .3
                        .push(convert::attributes_to_wire(&attributes).unwrap_or_default());
                }
                if let Some(last) = batch {
                    let _ = tx.blocking_send(last);
                }
                Ok(())
            })
        };
        let mut n_copied = 0u64;
        while let Some((user, doc_ids, vectors, attributes)) = rx.recv().await {
            n_copied += doc_ids.len() as u64;
            // A batch of documents without attributes is sent without them.
            let attributes = match attributes.iter().all(|a| a.values.is_empty()) {
                true => Vec::new(),
                false => attributes,
            };
            let request = pb::InsertRequest {
                collection: name.to_owned(),
                doc_ids: doc_ids.into_iter().map(convert::u128_to_id).collect(),
                user_ids: vec![convert::u128_to_id(user)],
                vectors,
                durability: pb::Durability::Fsync as i32,
                attributes,
            };
            self.routed_insert(cluster, request, None, api_key).await?;
        }
        reader
            .await
            .map_err(|e| ApiError::Internal(format!("the import reader: {e}")))??;
        Ok(n_copied)
    }
}

/// Deletes an import's temporary copy (a leftover is deleted at the next start anyway).
async fn remove_import_dir(dir: std::path::PathBuf) {
    let shown = dir.display().to_string();
    match tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&dir)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::NotFound => {}
        Ok(Err(error)) => tracing::warn!(dir = %shown, %error, "could not remove an import's copy"),
        Err(error) => tracing::warn!(dir = %shown, %error, "could not remove an import's copy"),
    }
}
