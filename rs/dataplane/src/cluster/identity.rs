//! The cluster's identity and the data directory's token: [`settle_identity`] (the cluster id in
//! etcd and in the directory's `CLUSTER_ID`, settled before the node registers) and
//! [`incarnation_token`] (the directory's `INCARNATION`, which its registrations carry).

use tarn_cluster::ClusterStore;

/// The name of the file in the data directory that holds its token ([`incarnation_token`]).
pub(crate) const INCARNATION_FILE: &str = "INCARNATION";

/// The data directory's token: 32 hex digits, made once (written to a temporary file, synced,
/// renamed, the directory synced) and read at every start. The caller holds the directory's
/// lock, so a cluster registration carrying this token belongs to this directory's previous
/// process, which is dead. A file that does not hold a token (damaged by hand) is replaced,
/// with a warning: the only cost is one start that waits for the old lease to lapse.
pub(crate) fn incarnation_token(data_dir: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context;
    let path = data_dir.join(INCARNATION_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let token = text.trim();
            if is_token(token) {
                return Ok(token.to_owned());
            }
            tracing::warn!(path = %path.display(), "not a data directory token; writing a new one");
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    let token = new_token();
    write_token_file(data_dir, INCARNATION_FILE, &token)?;
    Ok(token)
}

/// 32 random hex digits.
fn new_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Whether `text` is a token [`new_token`] made.
fn is_token(text: &str) -> bool {
    text.len() == 32 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Writes `data_dir/name` durably: a temporary file, synced, renamed, the directory synced.
fn write_token_file(data_dir: &std::path::Path, name: &str, token: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let path = data_dir.join(name);
    let staging = data_dir.join(format!("{name}.tmp"));
    let mut file = std::fs::File::create(&staging)
        .with_context(|| format!("creating {}", staging.display()))?;
    file.write_all(format!("{token}\n").as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", staging.display()))?;
    std::fs::rename(&staging, &path).with_context(|| format!("renaming to {}", path.display()))?;
    std::fs::File::open(data_dir)
        .and_then(|dir| dir.sync_all())
        .with_context(|| format!("syncing {}", data_dir.display()))?;
    Ok(())
}

/// The file in the data directory that names the cluster it belongs to.
pub(crate) const CLUSTER_ID_FILE: &str = "CLUSTER_ID";

/// Settles which cluster this data directory and the store belong to, before the node
/// registers: a cluster id is created in the store when the cluster forms (by its first node)
/// and recorded in every member's data directory (`CLUSTER_ID`). Then:
/// - directory and store name the same cluster: join;
/// - they name different clusters: refused (a wrong etcd, or a directory of another cluster);
/// - the directory names a cluster, the store none (an empty etcd, another one, one restored
///   from a backup older than the cluster): refused, unless `force_new_cluster` (the etcd is
///   lost for good): then a new id is created and recorded, and local shards the new map does
///   not know are set aside by reconciliation, never deleted;
/// - the directory names none (new, or written by a tarn before identities): it takes the
///   store's id, creating one if the store has none; but a directory that holds shards refuses
///   a store that holds nothing at all (no id, no node, no collection) unless
///   `force_new_cluster`.
pub(crate) async fn settle_identity(
    store: &dyn ClusterStore,
    data_dir: &std::path::Path,
    holds_shards: bool,
    force_new_cluster: bool,
) -> anyhow::Result<tarn_cluster::ClusterIdentity> {
    let path = data_dir.join(CLUSTER_ID_FILE);
    let local = match std::fs::read_to_string(&path) {
        Ok(text) if is_token(text.trim()) => Some(text.trim().to_owned()),
        Ok(_) => anyhow::bail!(
            "{} does not hold a cluster id; restore it from a backup, or delete it to join the \
             cluster etcd names",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(anyhow::Error::from(e).context(format!("reading {}", path.display()))),
    };
    let remote = store.identity().await?;
    let proposed = || tarn_cluster::ClusterIdentity {
        cluster_id: new_token(),
        node_secret: format!("{}{}", new_token(), new_token()),
    };
    let identity = match (local, remote.identity) {
        (Some(local), Some(remote)) if local == remote.cluster_id => return Ok(remote),
        (Some(local), Some(remote)) => anyhow::bail!(
            "this data directory ({}) belongs to cluster {local}, but etcd holds cluster \
             {}: --etcd points at another cluster's etcd, or the directory is another \
             cluster's. Refusing to join: its shards would be judged against a map they are not \
             in",
            data_dir.display(),
            remote.cluster_id
        ),
        (Some(local), None) if !force_new_cluster => anyhow::bail!(
            "this data directory ({}) belongs to cluster {local}, but etcd holds no cluster id \
             (an empty etcd, another one, or one restored from a backup older than the \
             cluster). Refusing to join: its shards would be judged against a map they are not \
             in. Point --etcd at the cluster's etcd; if that etcd is lost for good, start with \
             --force-new-cluster (a new cluster is formed; shards the new map does not know are \
             set aside, not deleted)",
            data_dir.display()
        ),
        (Some(local), None) => {
            let id = store.create_identity(&proposed()).await?;
            tracing::warn!(old = %local, new = %id.cluster_id, "--force-new-cluster: this data directory joins a new cluster");
            id
        }
        (None, Some(remote)) => {
            if holds_shards {
                tracing::warn!(cluster_id = %remote.cluster_id, "this data directory holds shards but no cluster id (written by an older tarn): it takes etcd's");
            }
            remote
        }
        (None, None) => {
            if holds_shards && !remote.holds_state && !force_new_cluster {
                anyhow::bail!(
                    "this data directory ({}) holds shards of a cluster, but etcd holds no \
                     cluster at all (no id, no node, no collection). Refusing to form a new \
                     cluster over them; point --etcd at the cluster's etcd, or start with \
                     --force-new-cluster (shards the new map does not know are set aside, not \
                     deleted)",
                    data_dir.display()
                );
            }
            let id = store.create_identity(&proposed()).await?;
            tracing::info!(cluster_id = %id.cluster_id, "cluster id settled");
            id
        }
    };
    write_token_file(data_dir, CLUSTER_ID_FILE, &identity.cluster_id)?;
    Ok(identity)
}
