//! A small client of etcd's v3 gRPC API: the calls [`crate::EtcdStore`] makes (range, put,
//! delete, transactions, leases and their keep-alive stream, the watch stream, elections), over
//! tonic clients generated from tarn's copy of etcd's protos (`proto/etcd/`, compiled with protox
//! by `build.rs`).
//!
//! Why not the `etcd-client` crate: its build script compiles etcd's protos with a system
//! `protoc`, so every build of tarn needed one installed (a Debian package, root), and it has
//! no option to use pre-generated code. The part of etcd's API tarn uses is small and frozen
//! (etcd keeps v3 backward compatible), so tarn carries those messages and calls them directly;
//! the behaviour that matters (leases, keep-alive, watch, election, transactions) is tested
//! against a real etcd in `tests/etcd.rs`.
//!
//! Every call returns etcd's gRPC status as is; [`crate::EtcdStore`] decides what a failure means.

use std::time::Duration;

use tokio::sync::mpsc;
use tonic::codegen::InterceptedService;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status, Streaming};

/// Generated code: etcd's `etcdserverpb` (KV, Watch, Lease and `mvccpb`'s KeyValue and Event).
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    missing_debug_implementations
)]
pub mod etcdserverpb {
    tonic::include_proto!("etcdserverpb");
}

/// Generated code: etcd's `v3electionpb` (Election).
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    missing_debug_implementations
)]
pub mod v3electionpb {
    tonic::include_proto!("v3electionpb");
}

use etcdserverpb::kv_client::KvClient;
use etcdserverpb::lease_client::LeaseClient;
use etcdserverpb::watch_client::WatchClient;
use etcdserverpb::{
    DeleteRangeRequest, DeleteRangeResponse, LeaseGrantRequest, LeaseGrantResponse,
    LeaseKeepAliveRequest, LeaseKeepAliveResponse, LeaseRevokeRequest, LeaseTimeToLiveRequest,
    LeaseTimeToLiveResponse, PutRequest, PutResponse, RangeRequest, RangeResponse, TxnRequest,
    TxnResponse, WatchCreateRequest, WatchRequest, WatchResponse,
};
use v3electionpb::election_client::ElectionClient;
use v3electionpb::{
    CampaignRequest, CampaignResponse, LeaderKey, LeaderRequest, LeaderResponse, ResignRequest,
};

/// How the channel to etcd is set up.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// How long opening a TCP connection to an endpoint may take.
    pub connect_timeout: Duration,
    /// HTTP/2 pings every `.0` on the connection, which counts as dead when one is not answered
    /// within `.1` (so a silent, not closed, connection is found).
    pub keep_alive: Option<(Duration, Duration)>,
    /// Sends etcd's `hasleader` metadata: an etcd member cut off from its cluster's leader
    /// refuses requests instead of serving stale reads or hanging writes.
    pub require_leader: bool,
    /// Largest gRPC message accepted from etcd.
    pub max_decoding_message_size: usize,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            connect_timeout: Duration::from_secs(3),
            keep_alive: None,
            require_leader: false,
            max_decoding_message_size: 4 << 20,
        }
    }
}

/// Adds the metadata every request carries.
#[derive(Debug, Clone)]
pub struct Metadata {
    require_leader: bool,
}

impl tonic::service::Interceptor for Metadata {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if self.require_leader {
            request
                .metadata_mut()
                .insert("hasleader", MetadataValue::from_static("true"));
        }
        Ok(request)
    }
}

type Svc = InterceptedService<Channel, Metadata>;

/// A client of one etcd cluster (one or several endpoints, balanced). Cheap to clone: clones
/// share the connections. Connects lazily: the first call opens the connection.
#[derive(Debug, Clone)]
pub struct EtcdClient {
    channel: Channel,
    metadata: Metadata,
    max_message: usize,
}

impl EtcdClient {
    /// A client of the etcd at `endpoints` (`http://host:port`). Fails only on a malformed
    /// endpoint: nothing is contacted until the first call.
    pub fn connect(endpoints: &[String], options: &ConnectOptions) -> Result<EtcdClient, String> {
        if endpoints.is_empty() {
            return Err("no etcd endpoint given".to_owned());
        }
        let mut list = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints {
            let uri = if endpoint.contains("://") {
                endpoint.clone()
            } else {
                format!("http://{endpoint}")
            };
            let mut e = Endpoint::from_shared(uri)
                .map_err(|e| format!("{endpoint:?} is not an etcd endpoint: {e}"))?
                .connect_timeout(options.connect_timeout);
            if let Some((interval, timeout)) = options.keep_alive {
                e = e
                    .http2_keep_alive_interval(interval)
                    .keep_alive_timeout(timeout)
                    .keep_alive_while_idle(true);
            }
            list.push(e);
        }
        let channel = if list.len() == 1 {
            list.remove(0).connect_lazy()
        } else {
            Channel::balance_list(list.into_iter())
        };
        Ok(EtcdClient {
            channel,
            metadata: Metadata {
                require_leader: options.require_leader,
            },
            max_message: options.max_decoding_message_size,
        })
    }

    fn kv(&self) -> KvClient<Svc> {
        KvClient::with_interceptor(self.channel.clone(), self.metadata.clone())
            .max_decoding_message_size(self.max_message)
    }

    fn lease(&self) -> LeaseClient<Svc> {
        LeaseClient::with_interceptor(self.channel.clone(), self.metadata.clone())
    }

    fn election(&self) -> ElectionClient<Svc> {
        ElectionClient::with_interceptor(self.channel.clone(), self.metadata.clone())
    }

    /// Reads the key, or with `prefix` every key starting with it.
    pub async fn get(&self, key: &[u8], prefix: bool) -> Result<RangeResponse, Status> {
        self.range(RangeRequest {
            key: key.to_vec(),
            range_end: if prefix { prefix_end(key) } else { Vec::new() },
            ..RangeRequest::default()
        })
        .await
    }

    /// Counts the keys starting with `prefix`.
    pub async fn count_prefix(&self, prefix: &[u8]) -> Result<i64, Status> {
        let response = self
            .range(RangeRequest {
                key: prefix.to_vec(),
                range_end: prefix_end(prefix),
                count_only: true,
                ..RangeRequest::default()
            })
            .await?;
        Ok(response.count)
    }

    pub async fn range(&self, request: RangeRequest) -> Result<RangeResponse, Status> {
        Ok(self.kv().range(request).await?.into_inner())
    }

    /// Writes `key`, attached to `lease` unless it is 0.
    pub async fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<PutResponse, Status> {
        let request = PutRequest {
            key: key.to_vec(),
            value: value.to_vec(),
            lease,
        };
        Ok(self.kv().put(request).await?.into_inner())
    }

    /// Deletes the key, or with `prefix` every key starting with it.
    pub async fn delete(&self, key: &[u8], prefix: bool) -> Result<DeleteRangeResponse, Status> {
        let request = delete_request(key, prefix);
        Ok(self.kv().delete_range(request).await?.into_inner())
    }

    pub async fn txn(&self, request: TxnRequest) -> Result<TxnResponse, Status> {
        Ok(self.kv().txn(request).await?.into_inner())
    }

    /// Grants a lease of `ttl_s` seconds (etcd may grant more: it has a minimum).
    pub async fn grant(&self, ttl_s: i64) -> Result<LeaseGrantResponse, Status> {
        let request = LeaseGrantRequest { ttl: ttl_s, id: 0 };
        let response = self.lease().lease_grant(request).await?.into_inner();
        if !response.error.is_empty() {
            return Err(Status::unknown(format!("lease grant: {}", response.error)));
        }
        Ok(response)
    }

    /// Revokes a lease: every key attached to it is deleted.
    pub async fn revoke(&self, id: i64) -> Result<(), Status> {
        self.lease().lease_revoke(LeaseRevokeRequest { id }).await?;
        Ok(())
    }

    /// What etcd knows of a lease: its remaining TTL (-1 once it is gone).
    pub async fn time_to_live(&self, id: i64) -> Result<LeaseTimeToLiveResponse, Status> {
        let request = LeaseTimeToLiveRequest { id, keys: false };
        Ok(self.lease().lease_time_to_live(request).await?.into_inner())
    }

    /// Opens a keep-alive stream for lease `id` and sends the first keep-alive: each
    /// [`KeepAlive::renew`] sends another, each answer comes on [`KeepAlive::answer`].
    pub async fn keep_alive(&self, id: i64) -> Result<KeepAlive, Status> {
        let (tx, rx) = mpsc::channel(4);
        tx.try_send(LeaseKeepAliveRequest { id })
            .map_err(|_| Status::internal("keep-alive channel full"))?;
        let answers = self
            .lease()
            .lease_keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(KeepAlive { id, tx, answers })
    }

    /// Opens a watch stream for `create`: the first answer says `created` (or `canceled` with a
    /// reason), then the events follow from `create.start_revision`.
    pub async fn watch(&self, create: WatchCreateRequest) -> Result<WatchStream, Status> {
        let (tx, rx) = mpsc::channel(1);
        tx.try_send(WatchRequest {
            request_union: Some(etcdserverpb::watch_request::RequestUnion::CreateRequest(
                create,
            )),
        })
        .map_err(|_| Status::internal("watch channel full"))?;
        let mut client = WatchClient::with_interceptor(self.channel.clone(), self.metadata.clone())
            .max_decoding_message_size(self.max_message);
        let events = client
            .watch(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(WatchStream { _tx: tx, events })
    }

    /// Campaigns in election `name` as `value` under `lease`: answers once elected.
    pub async fn campaign(
        &self,
        name: &[u8],
        value: &[u8],
        lease: i64,
    ) -> Result<CampaignResponse, Status> {
        let request = CampaignRequest {
            name: name.to_vec(),
            lease,
            value: value.to_vec(),
        };
        Ok(self.election().campaign(request).await?.into_inner())
    }

    /// The current leader of election `name` (NOT_FOUND-like error when there is none).
    pub async fn leader(&self, name: &[u8]) -> Result<LeaderResponse, Status> {
        let request = LeaderRequest {
            name: name.to_vec(),
        };
        Ok(self.election().leader(request).await?.into_inner())
    }

    /// Gives up a leadership won by [`EtcdClient::campaign`].
    pub async fn resign(&self, leader: LeaderKey) -> Result<(), Status> {
        let request = ResignRequest {
            leader: Some(leader),
        };
        self.election().resign(request).await?;
        Ok(())
    }
}

/// An open keep-alive stream of one lease.
#[derive(Debug)]
pub struct KeepAlive {
    id: i64,
    tx: mpsc::Sender<LeaseKeepAliveRequest>,
    answers: Streaming<LeaseKeepAliveResponse>,
}

impl KeepAlive {
    /// Sends one more keep-alive; fails once the stream is closed.
    pub async fn renew(&self) -> Result<(), Status> {
        self.tx
            .send(LeaseKeepAliveRequest { id: self.id })
            .await
            .map_err(|_| Status::unavailable("keep-alive stream closed"))
    }

    /// The next answer (`None`: the stream ended). A TTL of 0 or less: the lease is gone.
    pub async fn answer(&mut self) -> Result<Option<LeaseKeepAliveResponse>, Status> {
        self.answers.message().await
    }
}

/// An open watch stream. Dropping it closes the stream (etcd cancels the watch).
#[derive(Debug)]
pub struct WatchStream {
    /// Kept open: closing the request side ends the watch.
    _tx: mpsc::Sender<WatchRequest>,
    events: Streaming<WatchResponse>,
}

impl WatchStream {
    /// The next answer (`None`: the stream ended).
    pub async fn message(&mut self) -> Result<Option<WatchResponse>, Status> {
        self.events.message().await
    }
}

/// The `range_end` that selects every key starting with `prefix`: the prefix with its last byte
/// below 0xff incremented and what follows it dropped; `[0]` (every key from `prefix` on) when
/// there is no such byte.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// A delete of the key, or with `prefix` of every key starting with it.
pub fn delete_request(key: &[u8], prefix: bool) -> DeleteRangeRequest {
    DeleteRangeRequest {
        key: key.to_vec(),
        range_end: if prefix { prefix_end(key) } else { Vec::new() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/tarn/"), b"/tarn0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[test]
    fn malformed_endpoints_are_refused() {
        let options = ConnectOptions::default();
        assert!(EtcdClient::connect(&[], &options).is_err());
        assert!(EtcdClient::connect(&["http://bad host:1".to_owned()], &options).is_err());
    }
}
