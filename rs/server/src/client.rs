//! The client commands of the `tarn` binary.

use std::io::{BufReader, Read};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tarn_proto::v1 as pb;
use tarn_proto::v1::tarn_client::TarnClient;
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use hyper_util::rt::TokioIo;

use crate::cli::{ClientArgs, CollectionCommand, Command, InsertArgs, SearchArgs};
use crate::coalesce::Coalescing;
use crate::convert::{id_to_u128, u128_to_id};

pub(crate) type Client = TarnClient<InterceptedService<Channel, Auth>>;

/// Adds `authorization: Bearer <key>` to every call when a key is given.
#[derive(Clone)]
pub(crate) struct Auth(Option<MetadataValue<tonic::metadata::Ascii>>);

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
        Ok(request)
    }
}

pub(crate) async fn connect(args: &ClientArgs) -> anyhow::Result<Client> {
    let channel = open_channel(&args.addr, |endpoint| endpoint).await?;
    let auth = match &args.api_key {
        Some(key) => Some(
            format!("Bearer {key}")
                .parse()
                .context("API key is not valid header text")?,
        ),
        None => None,
    };
    Ok(TarnClient::with_interceptor(channel, Auth(auth))
        .max_decoding_message_size(256 << 20)
        .max_encoding_message_size(256 << 20))
}

/// Connects to `addr` (http://host:port, https://host:port or unix:/path), with the settings
/// (timeouts) that `configure` applies to the endpoint. Plain TCP and Unix-socket connections
/// send each request in one write ([`Coalescing`]); TLS connections use tonic's connector.
async fn open_channel(
    addr: &str,
    configure: impl FnOnce(Endpoint) -> Endpoint,
) -> anyhow::Result<Channel> {
    if let Some(path) = addr.strip_prefix("unix:") {
        // The endpoint's URI is required by the HTTP/2 layer but not used to connect.
        let path = std::path::PathBuf::from(path);
        return configure(Endpoint::from_static("http://localhost"))
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(Coalescing::new(stream)))
                }
            }))
            .await
            .with_context(|| format!("cannot connect to {addr}"));
    }
    let endpoint = configure(
        Endpoint::from_shared(addr.to_owned()).with_context(|| format!("bad address {addr}"))?,
    );
    if !addr.starts_with("http://") {
        return endpoint
            .connect()
            .await
            .with_context(|| format!("cannot connect to {addr}"));
    }
    endpoint
        .connect_with_connector(tower::service_fn(|uri: tonic::transport::Uri| async move {
            let host = uri.host().unwrap_or("localhost");
            // IPv6 literals come bracketed in the URI; `connect` wants them bare.
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = uri.port_u16().unwrap_or(80);
            let stream = tokio::net::TcpStream::connect((host, port)).await?;
            stream.set_nodelay(true)?;
            Ok::<_, std::io::Error>(TokioIo::new(Coalescing::new(stream)))
        }))
        .await
        .with_context(|| format!("cannot connect to {addr}"))
}

/// Reads a TEXMEX fvecs/ivecs file row by row: (dimension, rows as raw little-endian words).
pub(crate) fn read_vecs_rows(
    path: &Path,
    limit: Option<usize>,
) -> anyhow::Result<(usize, Vec<u32>)> {
    let mut reader = BufReader::new(
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?,
    );
    let mut words = Vec::new();
    let mut dim = 0usize;
    let mut rows = 0usize;
    let mut header = [0u8; 4];
    while limit.is_none_or(|l| rows < l) {
        match reader.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
        let row_dim = u32::from_le_bytes(header) as usize;
        if row_dim == 0 || (dim != 0 && row_dim != dim) {
            bail!("{}: row {rows} has dimension {row_dim}", path.display());
        }
        dim = row_dim;
        let mut row = vec![0u8; dim * 4];
        reader
            .read_exact(&mut row)
            .with_context(|| format!("{}: row {rows} cut short", path.display()))?;
        words.extend(
            row.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        rows += 1;
    }
    Ok((dim, words))
}

pub(crate) fn durability(name: Option<&str>) -> anyhow::Result<i32> {
    Ok(match name {
        None => pb::Durability::Unspecified,
        Some("fsync") => pb::Durability::Fsync,
        Some("written") => pb::Durability::Written,
        Some(other) => bail!("unknown durability {other:?} (fsync or written)"),
    } as i32)
}

fn print_info(info: &pb::CollectionInfo) {
    let metric =
        pb::Metric::try_from(info.metric).map_or("?".to_owned(), |m| m.as_str_name().to_owned());
    println!("name:               {}", info.name);
    println!("dimension:          {}", info.dimension);
    println!("metric:             {metric}");
    if let Some(h) = &info.hnsw {
        println!(
            "hnsw:               m={} ef_construction={} ef_search={}",
            h.m, h.ef_construction, h.ef_search
        );
    }
    println!(
        "documents:          {} ({} tenants)",
        info.n_documents, info.n_tenants
    );
    println!(
        "seq no:             last {} / durable {} / applied {} / checkpoint {}",
        info.last_seq_no, info.durable_seq_no, info.applied_seq_no, info.checkpoint_seq_no
    );
    println!(
        "sealed segments:    {} ({} removed, not compacted)",
        info.n_sealed_segments, info.n_removed_not_compacted
    );
    println!("bytes on disk:      {}", info.bytes_on_disk);
}

/// Recall bookkeeping for query `q` against an ivecs ground truth of `width` ids per row:
/// (true neighbours among the first `k` ids found, true neighbours counted).
pub(crate) fn recall_counts(
    truth: &[u32],
    width: usize,
    q: usize,
    ids: &[u128],
    k: usize,
) -> (usize, usize) {
    let row = &truth[q * width..q * width + k.min(width)];
    let found = ids
        .iter()
        .take(k)
        .filter(|id| row.iter().any(|t| u128::from(*t) == **id))
        .count();
    (found, row.len())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve(_) => unreachable!("handled by main"),
        Command::Healthcheck { addr } => {
            let channel = open_channel(&addr, |endpoint| {
                endpoint
                    .connect_timeout(Duration::from_secs(3))
                    .timeout(Duration::from_secs(3))
            })
            .await?;
            let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
            let reply = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                })
                .await?
                .into_inner();
            if reply.status
                != tonic_health::pb::health_check_response::ServingStatus::Serving as i32
            {
                bail!("server at {addr} is not serving");
            }
            println!("SERVING");
        }
        Command::Collection(command) => match command {
            CollectionCommand::Create {
                client,
                name,
                dimension,
                metric,
                m,
                ef_construction,
                ef_search,
                durability: d,
            } => {
                let metric = match metric.to_ascii_lowercase().as_str() {
                    "cosine" => pb::Metric::Cosine,
                    "l2" => pb::Metric::L2,
                    "dot" => pb::Metric::Dot,
                    other => bail!("unknown metric {other:?} (cosine, l2 or dot)"),
                };
                let reply = connect(&client)
                    .await?
                    .create_collection(pb::CreateCollectionRequest {
                        name,
                        dimension,
                        metric: metric as i32,
                        hnsw: Some(pb::HnswParams {
                            m,
                            ef_construction,
                            ef_search,
                        }),
                        default_durability: durability(Some(&d))?,
                    })
                    .await?
                    .into_inner();
                if let Some(info) = reply.collection {
                    print_info(&info);
                }
            }
            CollectionCommand::List { client } => {
                for name in connect(&client)
                    .await?
                    .list_collections(pb::ListCollectionsRequest {})
                    .await?
                    .into_inner()
                    .names
                {
                    println!("{name}");
                }
            }
            CollectionCommand::Info { client, name } => {
                let reply = connect(&client)
                    .await?
                    .get_collection(pb::GetCollectionRequest { name })
                    .await?
                    .into_inner();
                if let Some(info) = reply.collection {
                    print_info(&info);
                }
            }
            CollectionCommand::Drop { client, name } => {
                connect(&client)
                    .await?
                    .drop_collection(pb::DropCollectionRequest { name: name.clone() })
                    .await?;
                println!("dropped {name}");
            }
        },
        Command::Insert(args) => insert(args).await?,
        Command::Bench(command) => crate::bench::run(command).await?,
        Command::Search(args) => search(args).await?,
        Command::Get {
            client,
            collection,
            user_id,
            doc_ids,
        } => {
            let reply = connect(&client)
                .await?
                .get(pb::GetRequest {
                    collection,
                    user_id: Some(u128_to_id(user_id)),
                    doc_ids: doc_ids.iter().map(|d| u128_to_id(*d)).collect(),
                })
                .await?
                .into_inner();
            for doc in reply.docs {
                let id = doc.doc_id.as_ref().map_or(0, id_to_u128);
                println!("{id}\t{:?}", doc.vector);
            }
        }
        Command::Remove {
            client,
            collection,
            user_ids,
            doc_ids,
        } => {
            let reply = connect(&client)
                .await?
                .remove(pb::RemoveRequest {
                    collection,
                    doc_ids: doc_ids.iter().map(|d| u128_to_id(*d)).collect(),
                    user_ids: user_ids.iter().map(|u| u128_to_id(*u)).collect(),
                    durability: 0,
                })
                .await?
                .into_inner();
            println!("seq_no {}", reply.seq_no);
        }
        Command::Flush { client, collection } => {
            let reply = connect(&client)
                .await?
                .flush(pb::FlushRequest { collection })
                .await?
                .into_inner();
            println!("flushed_seq_no {}", reply.flushed_seq_no);
        }
    }
    Ok(())
}

async fn insert(args: InsertArgs) -> anyhow::Result<()> {
    let (dim, words) = read_vecs_rows(&args.fvecs, args.limit)?;
    let vectors: Vec<f32> = words.into_iter().map(f32::from_bits).collect();
    let n_rows = vectors.len() / dim.max(1);
    let client = connect(&args.client).await?;
    let durability = durability(args.durability.as_deref())?;
    let user_ids: Vec<pb::Id> = args.user_ids.iter().map(|u| u128_to_id(*u)).collect();
    let batch = args.batch.max(1);
    let progress = indicatif::ProgressBar::new(n_rows as u64);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} vectors {per_sec} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let vectors = Arc::new(vectors);
    let limit = Arc::new(tokio::sync::Semaphore::new(args.concurrency.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    let mut last_seq = 0;
    for start in (0..n_rows).step_by(batch) {
        let end = (start + batch).min(n_rows);
        let permit = Arc::clone(&limit).acquire_owned().await?;
        let (mut client, vectors, user_ids, progress) = (
            client.clone(),
            Arc::clone(&vectors),
            user_ids.clone(),
            progress.clone(),
        );
        let (collection, first_id) = (args.collection.clone(), args.first_id);
        tasks.spawn(async move {
            let request = pb::InsertRequest {
                collection,
                doc_ids: (start..end)
                    .map(|r| u128_to_id(first_id + r as u128))
                    .collect(),
                user_ids,
                vectors: vectors[start * dim..end * dim].to_vec(),
                durability,
            };
            let reply = client.insert(request).await;
            drop(permit);
            progress.inc((end - start) as u64);
            reply.map(|r| r.into_inner().seq_no)
        });
        while let Some(done) = tasks.try_join_next() {
            last_seq = last_seq.max(done??);
        }
    }
    while let Some(done) = tasks.join_next().await {
        last_seq = last_seq.max(done??);
    }
    progress.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "inserted {n_rows} vectors in {elapsed:.2} s: {:.0} vectors/s (last seq_no {last_seq})",
        n_rows as f64 / elapsed
    );
    Ok(())
}

async fn search(args: SearchArgs) -> anyhow::Result<()> {
    let (dim, words) = read_vecs_rows(&args.fvecs, args.limit)?;
    let queries: Vec<f32> = words.into_iter().map(f32::from_bits).collect();
    let truth = match &args.ivecs {
        Some(path) => Some(read_vecs_rows(path, args.limit)?),
        None => None,
    };
    let mut client = connect(&args.client).await?;
    let user_ids: Vec<pb::Id> = args.user_ids.iter().map(|u| u128_to_id(*u)).collect();
    let k = args.top_k as usize;
    let request = |vector: &[f32]| pb::SearchRequest {
        collection: args.collection.clone(),
        user_ids: user_ids.clone(),
        vector: vector.to_vec(),
        top_k: args.top_k,
        ef: args.ef,
        exact: args.exact,
        min_seq_no: 0,
    };
    for vector in queries.chunks_exact(dim).take(args.warmup) {
        client.search(request(vector)).await?;
    }
    let mut latencies = Vec::new();
    let (mut found, mut expected) = (0usize, 0usize);
    let started = Instant::now();
    for (q, vector) in queries.chunks_exact(dim).enumerate() {
        let t = Instant::now();
        let hits = client.search(request(vector)).await?.into_inner().hits;
        latencies.push(t.elapsed().as_secs_f64() * 1e3);
        let ids: Vec<u128> = hits
            .iter()
            .map(|h| h.doc_id.as_ref().map_or(0, id_to_u128))
            .collect();
        if args.verbose {
            println!(
                "query {q}: {:?}",
                hits.iter()
                    .map(|h| (h.doc_id.as_ref().map_or(0, id_to_u128), h.score))
                    .collect::<Vec<_>>()
            );
        }
        if let Some((width, rows)) = &truth {
            let (f, e) = recall_counts(rows, *width, q, &ids, k);
            found += f;
            expected += e;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    if latencies.is_empty() {
        bail!("no queries in {}", args.fvecs.display());
    }
    println!(
        "{} queries in {elapsed:.2} s: {:.0} q/s; latency p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms",
        latencies.len(),
        latencies.len() as f64 / elapsed,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.9),
        percentile(&latencies, 0.99)
    );
    if truth.is_some() {
        println!("recall@{k}: {:.4}", found as f64 / expected.max(1) as f64);
    }
    Ok(())
}
