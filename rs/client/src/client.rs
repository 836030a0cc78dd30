//! [`Client`]: one connection to a tarn server, shared by every task that clones it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tarn_proto::v1 as pb;
use tarn_proto::v1::tarn_client::TarnClient;
use tokio::io::AsyncRead;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::attributes::{FieldSpec, FieldType};
use crate::connect::{open_channel, Address, TlsOptions};
use crate::error::{Code, Error, Result};
use crate::snapshot::{feed_restore, Restored, SnapshotStream};
use crate::types::{
    id_to_wire, ClusterStatus, CollectionInfo, CollectionSpec, Count, Document, ForgetReport, Hit,
    Insert, ReadToken, Remove, Scroll, ScrollPage, Search, SetAsideShard, ShardKey, ShardStatus,
    WriteAck,
};

/// Largest message the client sends or accepts (a large batch of vectors, a large `get`).
const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// Adds `authorization: Bearer <key>` to every call when a key is set, and the builder's
/// extra metadata.
#[derive(Clone)]
struct Auth(
    Option<MetadataValue<Ascii>>,
    Arc<[(tonic::metadata::MetadataKey<Ascii>, MetadataValue<Ascii>)]>,
);

impl tonic::service::Interceptor for Auth {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        for (key, value) in self.1.iter() {
            request.metadata_mut().insert(key.clone(), value.clone());
        }
        Ok(request)
    }
}

type Stub = TarnClient<InterceptedService<Channel, Auth>>;

/// Settings of a [`Client`] before it connects: API key, TLS, deadlines.
///
/// ```no_run
/// # async fn example() -> tarn_client::Result<()> {
/// use std::time::Duration;
/// let pem = std::fs::read("ca.pem").expect("the CA certificate");
/// let client = tarn_client::Client::builder("https://tarn.internal:50051")
///     .api_key("s3cret")
///     .tls_ca_certificate(pem)
///     .timeout(Duration::from_secs(5))
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    address: String,
    api_key: Option<String>,
    tls: TlsOptions,
    timeout: Option<Duration>,
    connect_timeout: Option<Duration>,
    metadata: Vec<(String, String)>,
}

impl ClientBuilder {
    /// Sends this metadata (a gRPC header: lowercase ASCII name, ASCII value) with every call.
    pub fn metadata(mut self, name: impl Into<String>, value: impl Into<String>) -> ClientBuilder {
        self.metadata.push((name.into(), value.into()));
        self
    }

    /// Sends `authorization: Bearer <key>` with every call (servers started with `--api-key`).
    pub fn api_key(mut self, key: impl Into<String>) -> ClientBuilder {
        self.api_key = Some(key.into());
        self
    }

    /// Trusts this certificate authority (PEM) for `https://` addresses, instead of the Mozilla
    /// roots. May be called several times.
    pub fn tls_ca_certificate(mut self, pem: impl Into<Vec<u8>>) -> ClientBuilder {
        self.tls.ca_pem.push(pem.into());
        self
    }

    /// The name the server's certificate must carry, when it is not the address's host.
    pub fn tls_domain(mut self, domain: impl Into<String>) -> ClientBuilder {
        self.tls.domain = Some(domain.into());
        self
    }

    /// The deadline of every call that does not set its own (none by default). It is sent to the
    /// server (`grpc-timeout`), which stops waiting (for a read token, say) in time.
    pub fn timeout(mut self, timeout: Duration) -> ClientBuilder {
        self.timeout = Some(timeout);
        self
    }

    /// How long connecting may take (none by default).
    pub fn connect_timeout(mut self, timeout: Duration) -> ClientBuilder {
        self.connect_timeout = Some(timeout);
        self
    }

    /// Connects. Fails with INVALID_ARGUMENT for a malformed address or key, UNAVAILABLE if
    /// the server cannot be reached.
    pub async fn connect(self) -> Result<Client> {
        let address = Address::parse(&self.address)?;
        let auth = match &self.api_key {
            Some(key) => Some(
                format!("Bearer {key}")
                    .parse()
                    .map_err(|_| Error::invalid("api_key", "not valid header text"))?,
            ),
            None => None,
        };
        let mut metadata = Vec::with_capacity(self.metadata.len());
        for (name, value) in &self.metadata {
            let key = tonic::metadata::MetadataKey::<Ascii>::from_bytes(name.as_bytes()).map_err(
                |_| Error::invalid("metadata", format!("{name:?} is not a header name")),
            )?;
            let value = value.parse().map_err(|_| {
                Error::invalid("metadata", format!("{name}: not valid header text"))
            })?;
            metadata.push((key, value));
        }
        let auth = Auth(auth, metadata.into());
        let channel = open_channel(&address, self.connect_timeout, &self.tls).await?;
        let stub = TarnClient::with_interceptor(channel.clone(), auth.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Client {
            stub,
            channel,
            auth,
            timeout: self.timeout,
            address: Arc::from(self.address.as_str()),
        })
    }
}

/// A connection to a tarn server. Cheap to clone; the clones share the connection (one HTTP/2
/// connection multiplexes every call), and any number of tasks may use them at once.
///
/// ```no_run
/// # async fn example() -> tarn_client::Result<()> {
/// use tarn_client::{Client, CollectionSpec, Insert, Search};
/// let client = Client::connect("127.0.0.1:50051").await?;
/// client.create_collection(CollectionSpec::new("docs", 3)).await?;
/// let ack = client
///     .insert(Insert::new("docs", [1u128], vec![0.1f32, 0.2, 0.3]).users([7u128]))
///     .await?; // durable when it returns
/// let hits = client
///     .search(Search::new("docs", vec![0.1f32, 0.2, 0.3]).users([7u128]).after(ack.read_token()))
///     .await?;
/// assert_eq!(hits[0].doc_id, 1);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    stub: Stub,
    channel: Channel,
    auth: Auth,
    timeout: Option<Duration>,
    address: Arc<str>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("address", &self.address)
            .field("timeout", &self.timeout)
            .field("api_key", &self.auth.0.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl Client {
    /// Connects to `address` with the default settings: `host:port`, `http://host:port`,
    /// `https://host:port` (trusting the Mozilla roots) or `unix:/path`.
    pub async fn connect(address: impl Into<String>) -> Result<Client> {
        Client::builder(address).connect().await
    }

    /// Settings before connecting (API key, TLS, deadlines).
    pub fn builder(address: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            address: address.into(),
            api_key: None,
            tls: TlsOptions::default(),
            timeout: None,
            connect_timeout: None,
            metadata: Vec::new(),
        }
    }

    /// The address this client connected to, as given.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Runs one call with the call's deadline (or the client's), sent to the server as
    /// `grpc-timeout` and enforced here too.
    async fn call<T, R, F, Fut>(&self, message: T, timeout: Option<Duration>, rpc: F) -> Result<R>
    where
        F: FnOnce(Stub, tonic::Request<T>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    {
        let mut request = tonic::Request::new(message);
        let timeout = timeout.or(self.timeout);
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        let answer = rpc(self.stub.clone(), request);
        let answer = match timeout {
            Some(timeout) => match tokio::time::timeout(timeout, answer).await {
                Ok(answer) => answer,
                Err(_) => {
                    return Err(Error::new(
                        Code::DeadlineExceeded,
                        format!("no answer within {timeout:?}"),
                    ))
                }
            },
            None => answer.await,
        };
        Ok(answer?.into_inner())
    }

    /// Creates a collection; ALREADY_EXISTS if the name is taken.
    pub async fn create_collection(&self, spec: CollectionSpec) -> Result<CollectionInfo> {
        let reply = self
            .call(spec.into_wire(), None, |mut stub, request| async move {
                stub.create_collection(request).await
            })
            .await?;
        CollectionInfo::from_wire(reply.collection)
    }

    /// Drops a collection and deletes its data; NOT_FOUND if there is none of that name.
    pub async fn drop_collection(&self, name: &str) -> Result<()> {
        let request = pb::DropCollectionRequest {
            name: name.to_owned(),
        };
        self.call(request, None, |mut stub, request| async move {
            stub.drop_collection(request).await
        })
        .await?;
        Ok(())
    }

    /// The names of every collection.
    pub async fn list_collections(&self) -> Result<Vec<String>> {
        let reply = self
            .call(
                pb::ListCollectionsRequest {},
                None,
                |mut stub, request| async move { stub.list_collections(request).await },
            )
            .await?;
        Ok(reply.names)
    }

    /// A collection's settings and counters.
    pub async fn collection_info(&self, name: &str) -> Result<CollectionInfo> {
        let request = pb::GetCollectionRequest {
            name: name.to_owned(),
        };
        let reply = self
            .call(request, None, |mut stub, request| async move {
                stub.get_collection(request).await
            })
            .await?;
        CollectionInfo::from_wire(reply.collection)
    }

    /// Inserts (upserts) documents; returns once the write is durable in the mode asked for.
    pub async fn insert(&self, insert: Insert) -> Result<WriteAck> {
        let (request, timeout) = insert.into_wire();
        let reply = self
            .call(request, timeout, |mut stub, request| async move {
                stub.insert(request).await
            })
            .await?;
        Ok(WriteAck {
            seq_no: reply.seq_no,
            n_written: reply.n_inserted,
            token: reply.read_token,
        })
    }

    /// Removes documents; returns once the removal is durable in the mode asked for.
    pub async fn remove(&self, remove: Remove) -> Result<WriteAck> {
        let (request, timeout) = remove.into_wire();
        let reply = self
            .call(request, timeout, |mut stub, request| async move {
                stub.remove(request).await
            })
            .await?;
        Ok(WriteAck {
            seq_no: reply.seq_no,
            n_written: reply.n_removed,
            token: reply.read_token,
        })
    }

    /// Appends attribute fields to a collection (every shard of it, in cluster mode); documents
    /// written before have no value for them. Returns the collection's info, every field
    /// declared. INVALID_ARGUMENT naming `fields`, changing nothing, for an empty list, a bad
    /// or repeated name, or one already declared.
    ///
    /// ```no_run
    /// # async fn example(client: tarn_client::Client) -> tarn_client::Result<()> {
    /// use tarn_client::FieldType;
    /// client.add_fields("debian", [("priority", FieldType::Keyword)]).await?;
    /// # Ok(()) }
    /// ```
    pub async fn add_fields<N: Into<String>>(
        &self,
        collection: &str,
        fields: impl IntoIterator<Item = (N, FieldType)>,
    ) -> Result<CollectionInfo> {
        let request = pb::AddFieldsRequest {
            collection: collection.to_owned(),
            fields: fields
                .into_iter()
                .map(|(name, field_type)| FieldSpec::new(name, field_type).to_wire())
                .collect(),
        };
        let reply = self
            .call(request, None, |mut stub, request| async move {
                stub.add_fields(request).await
            })
            .await?;
        CollectionInfo::from_wire(reply.collection)
    }

    /// The nearest documents, best first.
    pub async fn search(&self, search: Search) -> Result<Vec<Hit>> {
        let (request, timeout) = search.into_wire();
        let reply = self
            .call(request, timeout, |mut stub, request| async move {
                stub.search(request).await
            })
            .await?;
        Ok(reply.hits.iter().map(Hit::from_wire).collect())
    }

    /// Many searches in one call (at most 1,000, of any collections), answered in order, each
    /// as [`Client::search`] answers it alone. The first that fails fails the call, its message
    /// naming it (`searches[3]: ...`). The longest of the searches' deadlines (or the
    /// client's) applies to the whole call, each search getting what is left of it. With
    /// [`Search::allow_partial`], the shards that did not answer are not reported (use
    /// [`Client::search_partial`] for that).
    ///
    /// ```no_run
    /// # async fn example(client: tarn_client::Client, queries: Vec<Vec<f32>>) -> tarn_client::Result<()> {
    /// use tarn_client::Search;
    /// let searches = queries.iter().map(|q| Search::new("debian", &q[..]).top_k(10));
    /// for hits in client.search_batch(searches).await? {
    ///     println!("{:?}", hits.first().map(|h| h.doc_id));
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn search_batch(
        &self,
        searches: impl IntoIterator<Item = Search>,
    ) -> Result<Vec<Vec<Hit>>> {
        let mut timeout: Option<std::time::Duration> = None;
        let searches = searches
            .into_iter()
            .map(|search| {
                let (request, own) = search.into_wire();
                timeout = timeout.max(own);
                request
            })
            .collect();
        let request = pb::SearchBatchRequest { searches };
        let reply = self
            .call(request, timeout, |mut stub, request| async move {
                stub.search_batch(request).await
            })
            .await?;
        Ok(reply
            .results
            .iter()
            .map(|result| result.hits.iter().map(Hit::from_wire).collect())
            .collect())
    }

    /// A search that may answer from part of the shards (cluster mode, with
    /// [`Search::allow_partial`]): the hits, and the shards that did not answer.
    pub async fn search_partial(&self, search: Search) -> Result<(Vec<Hit>, Vec<u32>)> {
        let (request, timeout) = search.into_wire();
        let reply = self
            .call(request, timeout, |mut stub, request| async move {
                stub.search(request).await
            })
            .await?;
        Ok((
            reply.hits.iter().map(Hit::from_wire).collect(),
            reply.missing_shards,
        ))
    }

    /// A stub of the `tarn.v1.Cluster` service on this client's connection.
    fn cluster_stub(
        &self,
    ) -> tarn_proto::v1::cluster_client::ClusterClient<
        tonic::service::interceptor::InterceptedService<Channel, Auth>,
    > {
        tarn_proto::v1::cluster_client::ClusterClient::with_interceptor(
            self.channel.clone(),
            self.auth.clone(),
        )
    }

    /// Cluster mode: the nodes and where every shard is, as the server asked sees them.
    /// FAILED_PRECONDITION from a server that is not in a cluster.
    pub async fn cluster_status(&self) -> Result<ClusterStatus> {
        let mut stub = self.cluster_stub();
        let mut request = tonic::Request::new(pb::ClusterStatusRequest {});
        if let Some(timeout) = self.timeout {
            request.set_timeout(timeout);
        }
        let reply = stub.status(request).await?.into_inner();
        Ok(ClusterStatus::from_wire(reply))
    }

    /// Cluster mode: gives the dead node `node_id`'s shards to live nodes as empty shards, their
    /// data lost for good (with `confirm` false, only lists what would be given up). Returns the
    /// shards with their new owners. FAILED_PRECONDITION while the node is alive.
    pub async fn forget_node(&self, node_id: &str, confirm: bool) -> Result<Vec<ShardStatus>> {
        Ok(self.forget_node_report(node_id, confirm).await?.given_up)
    }

    /// [`Client::forget_node`], with every shard the node held a copy of, by what becomes of
    /// it ([`ForgetReport`]).
    pub async fn forget_node_report(&self, node_id: &str, confirm: bool) -> Result<ForgetReport> {
        let mut stub = self.cluster_stub();
        let mut request = tonic::Request::new(pb::ForgetNodeRequest {
            node_id: node_id.to_owned(),
            confirm,
        });
        if let Some(timeout) = self.timeout {
            request.set_timeout(timeout);
        }
        let reply = stub.forget_node(request).await?.into_inner();
        let shards = |shards| {
            ClusterStatus::from_wire(pb::ClusterStatusResponse {
                shards,
                ..Default::default()
            })
            .shards
        };
        Ok(ForgetReport {
            given_up: shards(reply.shards),
            kept: shards(reply.kept),
            set_aside: shards(reply.set_aside),
        })
    }

    /// Cluster mode: marks `node_id` for draining (the placement coordinator moves its shards
    /// to the other nodes, one at a time, while they keep serving), or with `cancel` clears the
    /// mark. Answers at once with the shards the node owns now; follow
    /// [`Client::cluster_status`] until it owns none. NOT_FOUND for a node the cluster does not
    /// know.
    pub async fn drain_node(&self, node_id: &str, cancel: bool) -> Result<u32> {
        let mut stub = self.cluster_stub();
        let mut request = tonic::Request::new(pb::DrainRequest {
            node_id: node_id.to_owned(),
            cancel,
        });
        if let Some(timeout) = self.timeout {
            request.set_timeout(timeout);
        }
        Ok(stub.drain(request).await?.into_inner().shards_left)
    }

    /// Cluster mode: the shard copies the node asked set aside instead of deleting them (the
    /// map had no record of their collection, or their data was given up by forget).
    pub async fn list_set_aside(&self) -> Result<Vec<SetAsideShard>> {
        let mut stub = self.cluster_stub();
        let mut request = tonic::Request::new(pb::ListSetAsideRequest {});
        if let Some(timeout) = self.timeout {
            request.set_timeout(timeout);
        }
        let reply = stub.list_set_aside(request).await?.into_inner();
        Ok(reply
            .shards
            .into_iter()
            .map(|s| SetAsideShard {
                name: s.name,
                reason: s.reason,
                bytes: s.bytes,
            })
            .collect())
    }

    /// Cluster mode: deletes the set-aside copy `name` on the node asked, for good.
    pub async fn drop_set_aside(&self, name: &str) -> Result<()> {
        let mut stub = self.cluster_stub();
        let mut request = tonic::Request::new(pb::DropSetAsideRequest {
            name: name.to_owned(),
        });
        if let Some(timeout) = self.timeout {
            request.set_timeout(timeout);
        }
        stub.drop_set_aside(request).await?;
        Ok(())
    }

    /// Cluster mode: inserts every live document of the set-aside copy `name` (on the node
    /// asked) into the cluster collection `collection`; returns how many. The copy stays.
    pub async fn import_set_aside(&self, name: &str, collection: &str) -> Result<u64> {
        let mut stub = self.cluster_stub();
        let mut request = tonic::Request::new(pb::ImportSetAsideRequest {
            name: name.to_owned(),
            collection: collection.to_owned(),
        });
        if let Some(timeout) = self.timeout {
            request.set_timeout(timeout);
        }
        Ok(stub
            .import_set_aside(request)
            .await?
            .into_inner()
            .n_documents)
    }

    /// The stored documents of one tenant among `doc_ids`, with their attributes; ids not
    /// stored are absent.
    ///
    /// Without a token, a copy answers with what it has applied, which may lag a write just
    /// acknowledged; [`Client::get_after`] reads a given write.
    pub async fn get(
        &self,
        collection: &str,
        user_id: u128,
        doc_ids: &[u128],
    ) -> Result<Vec<Document>> {
        self.get_after(collection, user_id, doc_ids, &ReadToken::default())
            .await
    }

    /// [`Client::get`] that waits (within the client's deadline) until the write `after` is
    /// visible, on every shard asked (as [`Search::after`]): it either sees that write or
    /// fails.
    pub async fn get_after(
        &self,
        collection: &str,
        user_id: u128,
        doc_ids: &[u128],
        after: &ReadToken,
    ) -> Result<Vec<Document>> {
        self.get_selected(collection, user_id, doc_ids, &[], false, after)
            .await
    }

    /// [`Client::get_after`] returning only the declared fields `output_fields` lists (`"*"`
    /// or none: every field) and, with `with_payload`, each document's payload.
    pub async fn get_selected(
        &self,
        collection: &str,
        user_id: u128,
        doc_ids: &[u128],
        output_fields: &[&str],
        with_payload: bool,
        after: &ReadToken,
    ) -> Result<Vec<Document>> {
        let request = pb::GetRequest {
            output_fields: output_fields.iter().map(|f| f.to_string()).collect(),
            with_payload,
            collection: collection.to_owned(),
            user_id: Some(id_to_wire(user_id)),
            doc_ids: doc_ids.iter().copied().map(id_to_wire).collect(),
            // The token when the server gave one (it holds every shard's position), else the
            // sequence number (a token made by `ReadToken::from_seq_no`).
            min_seq_no: if after.as_bytes().is_empty() {
                after.seq_no()
            } else {
                0
            },
            read_token: after.as_bytes().to_vec(),
        };
        let reply = self
            .call(request, None, |mut stub, request| async move {
                stub.get(request).await
            })
            .await?;
        Ok(reply.docs.into_iter().map(Document::from_wire).collect())
    }

    /// The exact number of live documents a [`Count`] names (its tenants', matching its
    /// filter). Without a token, a copy counts what it has applied, which may lag a write just
    /// acknowledged ([`Count::after`]).
    ///
    /// ```no_run
    /// # async fn example(client: tarn_client::Client) -> tarn_client::Result<()> {
    /// use tarn_client::{Count, Filter};
    /// let n = client
    ///     .count(Count::new("debian").filter(Filter::field("section").eq("utils")))
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn count(&self, count: Count) -> Result<u64> {
        let (request, timeout) = count.into_wire();
        let reply = self
            .call(request, timeout, |mut stub, request| async move {
                stub.count(request).await
            })
            .await?;
        Ok(reply.count)
    }

    /// One page of a [`Scroll`]; pass [`ScrollPage::next`] to [`Scroll::cursor`] for the next.
    ///
    /// ```no_run
    /// # async fn example(client: tarn_client::Client) -> tarn_client::Result<()> {
    /// use tarn_client::Scroll;
    /// let mut cursor = Vec::new();
    /// loop {
    ///     let page = client
    ///         .scroll(Scroll::new("debian").limit(1000).vectors(true).cursor(cursor))
    ///         .await?;
    ///     for doc in &page.docs {
    ///         println!("{} {:?}", doc.doc_id, doc.attributes);
    ///     }
    ///     match page.next {
    ///         Some(next) => cursor = next,
    ///         None => break,
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn scroll(&self, scroll: Scroll) -> Result<ScrollPage> {
        let (request, timeout) = scroll.into_wire();
        let reply = self
            .call(request, timeout, |mut stub, request| async move {
                stub.scroll(request).await
            })
            .await?;
        Ok(ScrollPage {
            docs: reply.docs.into_iter().map(Document::from_wire).collect(),
            next: (!reply.next_cursor.is_empty()).then_some(reply.next_cursor),
        })
    }

    /// Checkpoints a collection now; returns the sequence number everything up to which is in
    /// the checkpoint.
    pub async fn flush(&self, collection: &str) -> Result<u64> {
        let request = pb::FlushRequest {
            collection: collection.to_owned(),
        };
        let reply = self
            .call(request, None, |mut stub, request| async move {
                stub.flush(request).await
            })
            .await?;
        Ok(reply.flushed_seq_no)
    }

    /// Starts a snapshot of a live collection: a copy consistent at one sequence number, which
    /// [`SnapshotStream`] streams (write it to a file with [`SnapshotStream::write_to`]).
    /// Writes and searches go on meanwhile. The client's deadline applies to starting the
    /// snapshot, not to streaming it.
    pub async fn create_snapshot(&self, collection: &str) -> Result<SnapshotStream> {
        let request = pb::CreateSnapshotRequest {
            collection: collection.to_owned(),
        };
        let stream = self
            .call(request, None, |mut stub, request| async move {
                stub.create_snapshot(request).await
            })
            .await?;
        let start = SnapshotStream::start(stream);
        match self.timeout {
            Some(timeout) => tokio::time::timeout(timeout, start).await.map_err(|_| {
                Error::new(
                    Code::DeadlineExceeded,
                    format!("the snapshot did not start within {timeout:?}"),
                )
            })?,
            None => start.await,
        }
    }

    /// Restores a snapshot file (as [`Client::create_snapshot`] wrote it) from `reader` as a new
    /// collection named `collection`. The collection appears only once the whole file has been
    /// received and verified; a damaged file is refused (INVALID_ARGUMENT naming the damage) and
    /// a taken name too (ALREADY_EXISTS), leaving nothing behind. No deadline applies (a large
    /// snapshot takes as long as it takes); drop the future to abandon the restore.
    pub async fn restore_snapshot(
        &self,
        collection: &str,
        reader: impl AsyncRead + Unpin + Send + 'static,
    ) -> Result<Restored> {
        self.restore_snapshot_sharded(collection, 0, ShardKey::User, reader)
            .await
    }

    /// [`Client::restore_snapshot`] into a cluster: the snapshot's documents become a new
    /// collection of `shards` shards (0: 8) placed by `shard_key`, the way a collection that
    /// started on one node moves into a cluster. The collection exists while it fills; a failed
    /// import drops it. A single server ignores the shard settings.
    pub async fn restore_snapshot_sharded(
        &self,
        collection: &str,
        shards: u32,
        shard_key: ShardKey,
        reader: impl AsyncRead + Unpin + Send + 'static,
    ) -> Result<Restored> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let sharding = (shards, shard_key.to_wire());
        let mut feeder = tokio::spawn(feed_restore(collection.to_owned(), sharding, reader, tx));
        let mut stub = self.stub.clone();
        let rpc = stub.restore_snapshot(tokio_stream::wrappers::ReceiverStream::new(rx));
        tokio::pin!(rpc);
        let mut sent = None;
        let reply = loop {
            tokio::select! {
                reply = &mut rpc => break reply,
                fed = &mut feeder, if sent.is_none() => match fed {
                    Ok(Ok(n)) => sent = Some(n),
                    // A read error abandons the call (dropping it resets the stream), so the
                    // server never mistakes a short file for the whole of it.
                    Ok(Err(error)) => {
                        return Err(Error::new(
                            Code::Cancelled,
                            format!("reading the snapshot: {error}"),
                        ))
                    }
                    Err(error) => {
                        return Err(Error::new(Code::Internal, format!("the reader task: {error}")))
                    }
                },
            }
        };
        let reply = reply?.into_inner();
        let bytes = match sent {
            Some(n) => n,
            None => match feeder.await {
                Ok(Ok(n)) => n,
                _ => 0,
            },
        };
        Ok(Restored {
            collection: CollectionInfo::from_wire(reply.collection)?,
            seq_no: reply.seq_no,
            bytes,
        })
    }

    /// Whether the server reports SERVING (`grpc.health.v1`, the whole server). A server whose
    /// collection's log failed reports NOT_SERVING until it restarts.
    pub async fn is_serving(&self) -> Result<bool> {
        use tonic_health::pb::health_check_response::ServingStatus;
        let mut health = tonic_health::pb::health_client::HealthClient::with_interceptor(
            self.channel.clone(),
            self.auth.clone(),
        );
        let mut request = tonic::Request::new(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        });
        if let Some(timeout) = self.timeout {
            request.set_timeout(timeout);
        }
        let reply = health.check(request).await?.into_inner();
        Ok(reply.status == ServingStatus::Serving as i32)
    }
}
