//! `tarn bench`: load generators against a running server, over real gRPC. Each run prints one
//! line of figures, or one JSON object with `--json` (what `scripts/bench-suite.sh` collects).
//!
//! - `insert`: random vectors from concurrent clients, each with its own connection and one
//!   request in flight; throughput and latency per client count.
//! - `search`: the queries of an fvecs file from concurrent clients at several `ef` values (and
//!   the exact path); queries/s, latency percentiles and recall@k against an ivecs ground truth.
//! - `freshness`: inserts at a fixed rate while probes search for a sample of the new vectors
//!   until they are found: the insert-to-searchable latency users see.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::{Rng, SeedableRng};
use tarn_client::{Client, Code, CollectionSpec, Durability, Insert, Search};

use crate::cli::{BenchCommand, BenchFreshnessArgs, BenchInsertArgs, BenchSearchArgs, ClientArgs};
use crate::client::{connect, durability, read_vecs_rows, recall_counts};

pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Insert(args) => insert(args).await,
        BenchCommand::Search(args) => search(args).await,
        BenchCommand::Freshness(args) => freshness(args).await,
    }
}

/// Latency percentiles of a sample, in milliseconds.
#[derive(Debug, Clone, Copy)]
struct Percentiles {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

impl Percentiles {
    fn of(mut millis: Vec<f64>) -> Percentiles {
        if millis.is_empty() {
            return Percentiles {
                p50: f64::NAN,
                p90: f64::NAN,
                p99: f64::NAN,
                max: f64::NAN,
            };
        }
        millis.sort_by(f64::total_cmp);
        let at = |p: f64| millis[((millis.len() - 1) as f64 * p).round() as usize];
        Percentiles {
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: millis[millis.len() - 1],
        }
    }
}

/// `n` connections (clients on one machine behave like separate processes, not one multiplexed
/// HTTP/2 connection).
async fn connections(args: &ClientArgs, n: usize) -> anyhow::Result<Vec<Client>> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(connect(args).await?);
    }
    Ok(clients)
}

/// Creates the collection (cosine, fsync) if it does not exist; checks the dimension if it does.
async fn ensure_collection(client: &Client, name: &str, dimension: u32) -> anyhow::Result<()> {
    match client.collection_info(name).await {
        Ok(info) => {
            if info.dimension != dimension {
                bail!(
                    "collection {name} has dimension {}, not {dimension}",
                    info.dimension
                );
            }
            Ok(())
        }
        Err(error) if error.code() == Code::NotFound => {
            client
                .create_collection(
                    CollectionSpec::new(name, dimension).default_durability(Durability::Fsync),
                )
                .await?;
            Ok(())
        }
        Err(error) => Err(error.into()),
    }
}

fn random_vectors(rng: &mut rand::rngs::StdRng, n: usize, dim: usize) -> Vec<f32> {
    (0..n * dim)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect()
}

async fn insert(args: BenchInsertArgs) -> anyhow::Result<()> {
    let dim = args.dimension as usize;
    let batch = args.batch.max(1);
    let admin = connect(&args.client).await?;
    ensure_collection(&admin, &args.collection, args.dimension).await?;
    let write_durability = durability(Some(&args.durability))?.unwrap_or(Durability::Fsync);
    let mut next_id = args.first_id;
    for &n_clients in &args.clients {
        let n_clients = n_clients.max(1);
        let clients = connections(&args.client, n_clients).await?;
        let per_client = args.requests.div_ceil(n_clients).max(1);
        // Requests are built before the clock starts: only the RPCs are timed.
        let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed ^ n_clients as u64);
        let mut plans = Vec::with_capacity(n_clients);
        for _ in 0..n_clients {
            let mut requests = Vec::with_capacity(per_client + 1);
            // One untimed request per connection first (HTTP/2 set-up, first touches).
            for _ in 0..per_client + 1 {
                let doc_ids: Vec<u128> = (0..batch as u128).map(|i| next_id + i).collect();
                requests.push(
                    Insert::new(
                        args.collection.as_str(),
                        doc_ids,
                        random_vectors(&mut rng, batch, dim),
                    )
                    .users([args.user_id])
                    .durability(write_durability),
                );
                next_id += batch as u128;
            }
            plans.push(requests);
        }
        let start = Arc::new(tokio::sync::Barrier::new(n_clients + 1));
        let mut tasks = tokio::task::JoinSet::new();
        for (client, requests) in clients.into_iter().zip(plans) {
            let start = Arc::clone(&start);
            tasks.spawn(async move {
                let mut requests = requests.into_iter();
                if let Some(first) = requests.next() {
                    client.insert(first).await?;
                }
                start.wait().await;
                let mut latencies = Vec::with_capacity(requests.len());
                for request in requests {
                    let t = Instant::now();
                    client.insert(request).await?;
                    latencies.push(t.elapsed().as_secs_f64() * 1e3);
                }
                Ok::<_, tarn_client::Error>((latencies, Instant::now()))
            });
        }
        start.wait().await;
        let started = Instant::now();
        let mut latencies = Vec::new();
        let mut finished = started;
        while let Some(done) = tasks.join_next().await {
            let (mut l, at) = done??;
            latencies.append(&mut l);
            finished = finished.max(at);
        }
        let seconds = finished.duration_since(started).as_secs_f64();
        let n_requests = latencies.len();
        let p = Percentiles::of(latencies);
        let (rps, vps) = (
            n_requests as f64 / seconds,
            (n_requests * batch) as f64 / seconds,
        );
        if args.json {
            println!(
                "{{\"bench\":\"insert\",\"clients\":{n_clients},\"batch\":{batch},\
                 \"durability\":\"{}\",\"requests\":{n_requests},\"vectors\":{},\
                 \"seconds\":{seconds:.6},\"requests_per_s\":{rps:.1},\"vectors_per_s\":{vps:.1},\
                 \"p50_ms\":{:.4},\"p90_ms\":{:.4},\"p99_ms\":{:.4},\"max_ms\":{:.4}}}",
                args.durability,
                n_requests * batch,
                p.p50,
                p.p90,
                p.p99,
                p.max
            );
        } else {
            println!(
                "insert clients={n_clients} batch={batch} durability={}: {n_requests} requests \
                 in {seconds:.3} s: {rps:.0} requests/s, {vps:.0} vectors/s; latency p50 \
                 {:.2} ms, p99 {:.2} ms",
                args.durability, p.p50, p.p99
            );
        }
    }
    Ok(())
}

async fn search(args: BenchSearchArgs) -> anyhow::Result<()> {
    let (dim, words) = read_vecs_rows(&args.fvecs, args.limit)?;
    let queries: Arc<Vec<f32>> = Arc::new(words.into_iter().map(f32::from_bits).collect());
    let n_queries = queries.len() / dim.max(1);
    if n_queries == 0 {
        bail!("no queries in {}", args.fvecs.display());
    }
    let truth = match &args.ivecs {
        Some(path) => Some(read_vecs_rows(path, args.limit)?),
        None => None,
    };
    let k = args.top_k as usize;
    let user_ids = args.user_ids.clone();
    // (ef, exact) runs: every --ef, then the exact path if asked.
    let mut modes: Vec<(u32, bool)> = args.ef.iter().map(|&ef| (ef, false)).collect();
    if args.exact {
        modes.push((0, true));
    }
    for &n_clients in &args.clients {
        let n_clients = n_clients.max(1);
        let clients = connections(&args.client, n_clients).await?;
        for &(ef, exact) in &modes {
            let request = {
                let (collection, user_ids, queries) = (
                    args.collection.clone(),
                    user_ids.clone(),
                    Arc::clone(&queries),
                );
                let top_k = args.top_k;
                move |q: usize| {
                    Search::new(collection.as_str(), &queries[q * dim..(q + 1) * dim])
                        .users(user_ids.clone())
                        .top_k(top_k)
                        .ef(ef)
                        .exact(exact)
                }
            };
            let start = Arc::new(tokio::sync::Barrier::new(n_clients + 1));
            let mut tasks = tokio::task::JoinSet::new();
            for (c, client) in clients.iter().enumerate() {
                let (client, start, request) =
                    (client.clone(), Arc::clone(&start), request.clone());
                let (warmup, passes) = (args.warmup, args.passes.max(1));
                tasks.spawn(async move {
                    for q in (c..n_queries).step_by(n_clients).take(warmup) {
                        client.search(request(q)).await?;
                    }
                    start.wait().await;
                    // Client c takes queries c, c + n, c + 2n, ...: every query once per run.
                    let mut out = Vec::new();
                    let mine = (c..n_queries).step_by(n_clients);
                    for q in std::iter::repeat_n(mine, passes).flatten() {
                        let t = Instant::now();
                        let hits = client.search(request(q)).await?;
                        let ms = t.elapsed().as_secs_f64() * 1e3;
                        let ids: Vec<u128> = hits.iter().map(|h| h.doc_id).collect();
                        out.push((q, ms, ids));
                    }
                    Ok::<_, tarn_client::Error>((out, Instant::now()))
                });
            }
            start.wait().await;
            let started = Instant::now();
            let mut finished = started;
            let mut latencies = Vec::with_capacity(n_queries);
            let (mut found, mut expected) = (0usize, 0usize);
            while let Some(done) = tasks.join_next().await {
                let (results, at) = done??;
                finished = finished.max(at);
                for (q, ms, ids) in results {
                    latencies.push(ms);
                    if let Some((width, rows)) = &truth {
                        let (f, e) = recall_counts(rows, *width, q, &ids, k);
                        found += f;
                        expected += e;
                    }
                }
            }
            let seconds = finished.duration_since(started).as_secs_f64();
            let n_done = latencies.len();
            let qps = n_done as f64 / seconds;
            let p = Percentiles::of(latencies);
            let recall = truth
                .as_ref()
                .map(|_| found as f64 / expected.max(1) as f64);
            let mode = if exact {
                "exact".to_owned()
            } else {
                format!("ef={ef}")
            };
            if args.json {
                println!(
                    "{{\"bench\":\"search\",\"clients\":{n_clients},\"ef\":{ef},\"exact\":{exact},\
                     \"queries\":{n_done},\"seconds\":{seconds:.6},\"queries_per_s\":{qps:.1},\
                     \"p50_ms\":{:.4},\"p90_ms\":{:.4},\"p99_ms\":{:.4},\"recall\":{}}}",
                    p.p50,
                    p.p90,
                    p.p99,
                    recall.map_or("null".to_owned(), |r| format!("{r:.4}"))
                );
            } else {
                println!(
                    "search clients={n_clients} {mode}: {n_done} queries in {seconds:.2} s: \
                     {qps:.0} q/s; latency p50 {:.2} ms, p99 {:.2} ms{}",
                    p.p50,
                    p.p99,
                    recall.map_or(String::new(), |r| format!("; recall@{k} {r:.4}"))
                );
            }
        }
    }
    Ok(())
}

async fn freshness(args: BenchFreshnessArgs) -> anyhow::Result<()> {
    let dim = args.dimension as usize;
    let admin = connect(&args.client).await?;
    ensure_collection(&admin, &args.collection, args.dimension).await?;
    let writers = connections(&args.client, args.connections.max(1)).await?;
    let prober = connect(&args.client).await?;
    let rate = args.rate.max(1);
    let total = (rate as f64 * args.seconds) as usize;
    let sample_every = args.sample_every.max(1);
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    let mut probes: Vec<(f64, f64, f64)> = Vec::new();
    let started = Instant::now();
    for i in 0..total {
        ticker.tick().await;
        let doc_id = args.first_id + i as u128;
        let vector = random_vectors(&mut rng, 1, dim);
        let writer = writers[i % writers.len()].clone();
        let prober = prober.clone();
        let collection = args.collection.clone();
        let user = args.user_id;
        let probe = i % sample_every == 0;
        tasks.spawn(async move {
            let sent = Instant::now();
            writer
                .insert(
                    Insert::new(collection.as_str(), [doc_id], vector.as_slice())
                        .users([user])
                        .durability(Durability::Fsync),
                )
                .await?;
            let acked = Instant::now();
            if !probe {
                return Ok::<_, tarn_client::Error>(None);
            }
            // Search for the new vector (approximate, default ef) until it comes back.
            let deadline = acked + Duration::from_secs(10);
            loop {
                let hits = prober
                    .search(
                        Search::new(collection.as_str(), vector.as_slice())
                            .users([user])
                            .top_k(10),
                    )
                    .await?;
                let now = Instant::now();
                if hits.iter().any(|h| h.doc_id == doc_id) {
                    let ms = |d: Duration| d.as_secs_f64() * 1e3;
                    return Ok(Some((ms(now - sent), ms(now - acked), ms(acked - sent))));
                }
                if now > deadline {
                    return Ok(Some((f64::INFINITY, f64::INFINITY, 0.0)));
                }
            }
        });
        while let Some(done) = tasks.try_join_next() {
            if let Some(probe) = done.context("freshness task")?? {
                probes.push(probe);
            }
        }
    }
    while let Some(done) = tasks.join_next().await {
        if let Some(probe) = done.context("freshness task")?? {
            probes.push(probe);
        }
    }
    let mut to_searchable = Vec::new();
    let mut after_ack = Vec::new();
    let mut ack = Vec::new();
    let mut n_missed = 0usize;
    for (total_ms, after_ms, ack_ms) in probes {
        if total_ms.is_finite() {
            to_searchable.push(total_ms);
            after_ack.push(after_ms);
            ack.push(ack_ms);
        } else {
            n_missed += 1;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let n_probed = to_searchable.len();
    let (t, a, w) = (
        Percentiles::of(to_searchable),
        Percentiles::of(after_ack),
        Percentiles::of(ack),
    );
    if args.json {
        println!(
            "{{\"bench\":\"freshness\",\"rate\":{rate},\"inserts\":{total},\"seconds\":{seconds:.3},\
             \"probed\":{n_probed},\"missed\":{n_missed},\
             \"to_searchable_p50_ms\":{:.4},\"to_searchable_p99_ms\":{:.4},\"to_searchable_max_ms\":{:.4},\
             \"after_ack_p50_ms\":{:.4},\"after_ack_p99_ms\":{:.4},\"ack_p50_ms\":{:.4},\"ack_p99_ms\":{:.4}}}",
            t.p50, t.p99, t.max, a.p50, a.p99, w.p50, w.p99
        );
    } else {
        println!(
            "freshness at {rate} inserts/s ({total} inserts in {seconds:.1} s, {n_probed} probed, \
             {n_missed} not found within 10 s): insert-to-searchable p50 {:.2} ms, p99 {:.2} ms, \
             max {:.2} ms (of which the durable ack p50 {:.2} ms, p99 {:.2} ms; after the ack \
             p50 {:.2} ms, p99 {:.2} ms)",
            t.p50, t.p99, t.max, w.p50, w.p99, a.p50, a.p99
        );
    }
    if n_missed > 0 {
        bail!("{n_missed} probed inserts were not found by search within 10 s");
    }
    Ok(())
}
