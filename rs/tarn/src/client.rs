//! The client commands of the `tarn` binary.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tarn_client::{
    Attributes, Client, CollectionInfo, CollectionSpec, Durability, FieldSpec, FieldType, Filter,
    Insert, Metric, Quantization, Remove, Search, Value,
};

use crate::cli::{
    ClientArgs, ClusterCommand, CollectionCommand, Command, InsertArgs, SearchArgs, SetAsideCommand,
};

/// Connects to the server the command names (`--addr`, `--api-key`).
pub(crate) async fn connect(args: &ClientArgs) -> anyhow::Result<Client> {
    let mut builder = Client::builder(args.addr.as_str());
    if let Some(key) = &args.api_key {
        builder = builder.api_key(key.as_str());
    }
    Ok(builder.connect().await?)
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

/// `fsync` or `written`; none: the collection's default.
pub(crate) fn durability(name: Option<&str>) -> anyhow::Result<Option<Durability>> {
    Ok(name.map(str::parse).transpose()?)
}

fn print_info(info: &CollectionInfo) {
    println!("name:               {}", info.name);
    println!("dimension:          {}", info.dimension);
    println!(
        "metric:             {}",
        info.metric.as_str().to_ascii_uppercase()
    );
    println!(
        "hnsw:               m={} ef_construction={} ef_search={}",
        info.m, info.ef_construction, info.ef_search
    );
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
    println!(
        "unindexed:          {} (searched exactly until indexed)",
        info.n_unindexed
    );
    println!("bytes on disk:      {}", info.bytes_on_disk);
    println!("bytes in memory:    {}", info.memory_bytes);
    if info.vectors_on_disk {
        println!(
            "vectors on disk:    yes ({} bytes read only to rescore and for get)",
            info.cold_bytes
        );
    }
    match info.quantization {
        Quantization::Int8 { rescore } => {
            println!("quantization:       int8 (rescore x{rescore})")
        }
        Quantization::Rabitq { bits, rescore } => {
            println!("quantization:       rabitq {bits} bit(s) (rescore x{rescore})")
        }
        _ => println!("quantization:       none"),
    }
    if info.shards > 1 {
        println!(
            "shards:             {} (by {:?}; counters are sums over the shards)",
            info.shards, info.shard_key
        );
    }
    if info.replication_factor > 1 {
        println!(
            "copies:             {} per shard, writes need {} in sync",
            info.replication_factor, info.min_in_sync
        );
    }
    if !info.fields.is_empty() {
        let fields: Vec<String> = info
            .fields
            .iter()
            .map(|f| format!("{} ({})", f.name, f.field_type))
            .collect();
        println!("fields:             {}", fields.join(", "));
    }
}

/// `NAME:TYPE` of `--field`.
fn parse_field(text: &str) -> anyhow::Result<(String, FieldType)> {
    let Some((name, field_type)) = text.rsplit_once(':') else {
        bail!("--field {text:?}: expected NAME:TYPE, e.g. section:keyword");
    };
    let field_type: FieldType = field_type
        .parse()
        .with_context(|| format!("--field {text:?}"))?;
    Ok((name.to_owned(), field_type))
}

/// The `--filter` text as a filter over the collection's declared fields.
async fn parse_filter(client: &Client, collection: &str, text: &str) -> anyhow::Result<Filter> {
    let info = client.collection_info(collection).await?;
    let declared: Vec<String> = info.fields.iter().map(|f| f.name.clone()).collect();
    let field_type = |name: &str| {
        info.fields
            .iter()
            .find(|f| f.name == name)
            .map(|f| f.field_type)
    };
    crate::filter_expr::parse(text, &field_type, &declared)
        .map_err(|error| anyhow::anyhow!("--filter: {}", error.show(text)))
}

/// Reads `rows` documents' attributes from a JSON-lines file (gzipped when it starts with
/// gzip's magic bytes): one object per row, keys converted by the declared `fields`' types,
/// null values and undeclared keys left out (the undeclared ones are named once on stderr).
/// A text file's lines, gunzipped when it is gzipped.
fn open_text(path: &Path) -> anyhow::Result<Box<dyn BufRead>> {
    let shown = path.display();
    let mut file =
        BufReader::new(std::fs::File::open(path).with_context(|| format!("opening {shown}"))?);
    let gzipped = file
        .fill_buf()
        .with_context(|| format!("reading {shown}"))?
        .starts_with(&[0x1f, 0x8b]);
    Ok(if gzipped {
        Box::new(BufReader::new(flate2::bufread::MultiGzDecoder::new(file)))
    } else {
        Box::new(file)
    })
}

fn read_attributes(
    path: &Path,
    rows: usize,
    fields: &[FieldSpec],
) -> anyhow::Result<Vec<Attributes>> {
    let shown = path.display();
    let reader = open_text(path)?;
    let mut ignored = std::collections::BTreeSet::new();
    let mut documents = Vec::with_capacity(rows);
    for (row, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("reading {shown}"))?;
        if row >= rows {
            if line.trim().is_empty() {
                continue;
            }
            bail!("{shown} has more rows than the {rows} vectors inserted");
        }
        let object: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&line)
            .with_context(|| format!("{shown}: row {row} is not a JSON object"))?;
        documents.push(
            object_attributes(object, fields, &mut ignored)
                .with_context(|| format!("{shown}: row {row}"))?,
        );
    }
    if documents.len() < rows {
        bail!(
            "{shown} has {} rows for {rows} vectors: one JSON object per vector",
            documents.len()
        );
    }
    if !ignored.is_empty() {
        let keys: Vec<String> = ignored.into_iter().collect();
        eprintln!(
            "note: keys the collection does not declare are left out: {}",
            keys.join(", ")
        );
    }
    Ok(documents)
}

/// A JSON object's values for the declared fields, converted to their types; null values are
/// left out, and undeclared keys too (added to `ignored`).
fn object_attributes(
    object: serde_json::Map<String, serde_json::Value>,
    fields: &[FieldSpec],
    ignored: &mut std::collections::BTreeSet<String>,
) -> anyhow::Result<Attributes> {
    let mut attributes = Attributes::new();
    for (key, json) in object {
        let Some(spec) = fields.iter().find(|f| f.name == key) else {
            ignored.insert(key);
            continue;
        };
        if json.is_null() {
            continue;
        }
        let value = json_value(spec.field_type, &json).ok_or_else(|| {
            anyhow::anyhow!(
                "field {key:?} is a {} field but holds {json}",
                spec.field_type
            )
        })?;
        attributes.insert(key, value);
    }
    Ok(attributes)
}

/// A document of a JSON-lines file (`tarn insert --jsonl`, what `tarn scroll` prints).
struct JsonDocument {
    /// Its tenant (`None`: the `--user-id` flags').
    user_id: Option<u128>,
    doc_id: u128,
    vector: Vec<f32>,
    attributes: Attributes,
}

/// An id in a JSON document: a decimal string (any u128) or a non-negative integer.
fn json_id(json: &serde_json::Value) -> Option<u128> {
    match json {
        serde_json::Value::String(text) => text.parse().ok(),
        serde_json::Value::Number(number) => number.as_u64().map(u128::from),
        _ => None,
    }
}

/// Reads the documents of a JSON-lines file (gzipped or not), one object per line:
/// `doc_id` and `vector` required, `user_id`, `attributes` (converted as `--attributes`
/// converts them) and `payload` (any JSON value) optional; at most `limit` of them.
fn read_documents_jsonl(
    path: &Path,
    limit: Option<usize>,
    fields: &[FieldSpec],
) -> anyhow::Result<Vec<JsonDocument>> {
    let shown = path.display();
    let reader = open_text(path)?;
    let mut ignored = std::collections::BTreeSet::new();
    let mut documents = Vec::new();
    for (row, line) in reader.lines().enumerate() {
        if limit.is_some_and(|limit| documents.len() >= limit) {
            break;
        }
        let line = line.with_context(|| format!("reading {shown}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{shown}: line {}", row + 1);
        let mut object: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&line).with_context(|| format!("{}: not a JSON object", at()))?;
        let doc_id = object
            .get("doc_id")
            .and_then(json_id)
            .with_context(|| format!("{}: no doc_id (a decimal string or an integer)", at()))?;
        let user_id = match object.get("user_id") {
            None | Some(serde_json::Value::Null) => None,
            Some(json) => Some(json_id(json).with_context(|| {
                format!("{}: user_id is not a decimal string or an integer", at())
            })?),
        };
        let vector = object
            .get("vector")
            .and_then(|v| v.as_array())
            .and_then(|values| {
                values
                    .iter()
                    .map(|x| x.as_f64().map(|x| x as f32))
                    .collect::<Option<Vec<f32>>>()
            })
            .with_context(|| format!("{}: no vector (an array of numbers)", at()))?;
        let mut attributes = match object.remove("attributes") {
            None | Some(serde_json::Value::Null) => Attributes::new(),
            Some(serde_json::Value::Object(values)) => {
                object_attributes(values, fields, &mut ignored).with_context(at)?
            }
            Some(other) => bail!("{}: attributes is not an object: {other}", at()),
        };
        if let Some(payload) = object.remove("payload").filter(|p| !p.is_null()) {
            attributes = attributes.with_payload(payload.to_string());
        }
        documents.push(JsonDocument {
            user_id,
            doc_id,
            vector,
            attributes,
        });
    }
    if !ignored.is_empty() {
        let keys: Vec<String> = ignored.into_iter().collect();
        eprintln!(
            "note: attributes the collection does not declare are left out: {}",
            keys.join(", ")
        );
    }
    Ok(documents)
}

/// A JSON value as a field's value; None if it does not fit the type.
fn json_value(field_type: FieldType, json: &serde_json::Value) -> Option<Value> {
    use serde_json::Value as Json;
    match (field_type, json) {
        (FieldType::Keyword, Json::String(text)) => Some(Value::Keyword(text.clone())),
        (FieldType::Keywords, Json::String(text)) => Some(Value::Keywords(vec![text.clone()])),
        (FieldType::Keywords, Json::Array(items)) => items
            .iter()
            .map(|item| item.as_str().map(str::to_owned))
            .collect::<Option<Vec<String>>>()
            .map(Value::Keywords),
        (FieldType::Number, Json::Number(number)) => number.as_f64().map(Value::Number),
        (FieldType::Bool, Json::Bool(boolean)) => Some(Value::Bool(*boolean)),
        (FieldType::Text, Json::String(text)) => Some(Value::Text(text.clone())),
        _ => None,
    }
}

/// One document's attributes as a JSON object (for `tarn get`).
fn attributes_json(attributes: &Attributes) -> serde_json::Value {
    let object = attributes
        .iter()
        .map(|(name, value)| {
            let value = match value {
                Value::Keyword(text) => serde_json::json!(text),
                Value::Keywords(list) => serde_json::json!(list),
                Value::Number(number) => serde_json::json!(number),
                Value::Bool(boolean) => serde_json::json!(boolean),
                Value::Text(text) => serde_json::json!(text),
                _ => serde_json::Value::Null,
            };
            (name.to_owned(), value)
        })
        .collect();
    serde_json::Value::Object(object)
}

/// Fills each shard's replication lag from its primary's own status (only a primary knows how
/// far its replicas are behind): one status call per other live node; a node that does not
/// answer leaves its shards' lag unknown (empty).
async fn with_replication_lag(
    mut status: tarn_client::ClusterStatus,
    args: &ClientArgs,
) -> tarn_client::ClusterStatus {
    let primaries: std::collections::BTreeSet<&str> = status
        .shards
        .iter()
        .filter(|s| !s.replicas.is_empty() && s.replication_lag.is_empty())
        .map(|s| s.node_id.as_str())
        .collect();
    let mut lags = std::collections::HashMap::new();
    for node in status
        .nodes
        .iter()
        .filter(|n| n.alive && !n.address.is_empty())
    {
        if !primaries.contains(node.node_id.as_str()) {
            continue;
        }
        let args = ClientArgs {
            addr: node.address.clone(),
            api_key: args.api_key.clone(),
        };
        let Ok(client) = connect(&args).await else {
            continue;
        };
        let Ok(theirs) = client.cluster_status().await else {
            continue;
        };
        for shard in theirs.shards {
            if shard.node_id == node.node_id && !shard.replication_lag.is_empty() {
                lags.insert((shard.collection, shard.shard), shard.replication_lag);
            }
        }
    }
    for shard in &mut status.shards {
        if shard.replication_lag.is_empty() {
            if let Some(lag) = lags.remove(&(shard.collection.clone(), shard.shard)) {
                shard.replication_lag = lag;
            }
        }
    }
    status
}

fn print_cluster_status(status: &tarn_client::ClusterStatus, json: bool) {
    if json {
        let value = serde_json::json!({
            "etcd_connected": status.etcd_connected,
            "cluster_id": status.cluster_id,
            "set_aside": status.set_aside,
            "unreadable": status.unreadable,
            "nodes": status.nodes.iter().map(|n| serde_json::json!({
                "node_id": n.node_id, "address": n.address, "alive": n.alive,
                "draining": n.draining,
            })).collect::<Vec<_>>(),
            "shards": status.shards.iter().map(|s| serde_json::json!({
                "collection": s.collection, "shard": s.shard, "node_id": s.node_id,
                "epoch": s.epoch, "state": s.state, "moving_to": s.moving_to,
                "move_problem": s.move_problem, "replicas": s.replicas,
                "in_sync": s.in_sync, "min_in_sync": s.min_in_sync,
                "replication_lag": s.replication_lag.iter().map(|l| serde_json::json!({
                    "node_id": l.node_id, "entries": l.entries, "in_sync": l.in_sync,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        });
        println!("{value}");
        return;
    }
    println!(
        "etcd: {}",
        if status.etcd_connected {
            "connected"
        } else {
            "unreachable (serving with the last shard map)"
        }
    );
    println!("cluster: {}", status.cluster_id);
    if status.set_aside > 0 {
        println!(
            "this node set {} shard copies aside (not deleted): `tarn cluster set-aside list`",
            status.set_aside
        );
    }
    for name in &status.unreadable {
        println!("collection {name}: its record in etcd cannot be read by this node");
    }
    println!("{:<16} {:<24} alive", "node", "address");
    for node in &status.nodes {
        println!(
            "{:<16} {:<24} {}{}",
            node.node_id,
            node.address,
            node.alive,
            if node.draining { " (draining)" } else { "" }
        );
    }
    println!(
        "{:<20} {:>5} {:<16} {:>6} state",
        "collection", "shard", "node", "epoch"
    );
    for shard in &status.shards {
        println!(
            "{:<20} {:>5} {:<16} {:>6} {}",
            shard.collection,
            shard.shard,
            shard.node_id,
            shard.epoch,
            if shard.moving_to.is_empty() {
                shard.state.clone()
            } else {
                format!("{} (moving to {})", shard.state, shard.moving_to)
            }
        );
        if !shard.replicas.is_empty() {
            let under = if (shard.in_sync.len() as u32) < shard.min_in_sync {
                " UNDER-REPLICATED: writes refused"
            } else if shard.in_sync.len() < shard.replicas.len() + 1 {
                " (a copy is catching up)"
            } else {
                ""
            };
            let lag = if shard.replication_lag.is_empty() {
                "unknown (the primary did not answer)".to_owned()
            } else {
                shard
                    .replication_lag
                    .iter()
                    .map(|l| format!("{} {}", l.node_id, l.entries))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            println!(
                "{:>27} replicas {} ; in sync {} of {} (writes need {}){under}; lag (entries) {lag}",
                "",
                shard.replicas.join(","),
                shard.in_sync.join(","),
                shard.replicas.len() + 1,
                shard.min_in_sync
            );
        }
        if !shard.move_problem.is_empty() {
            println!("{:>27} {}", "", shard.move_problem);
        }
    }
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

/// Runs one client command of the `tarn` binary (every command but `serve`).
pub async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve(_) => bail!("`tarn serve` is not a client command"),
        Command::Healthcheck { addr } => {
            let client = Client::builder(addr.as_str())
                .connect_timeout(Duration::from_secs(3))
                .timeout(Duration::from_secs(3))
                .connect()
                .await?;
            if !client.is_serving().await? {
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
                shards,
                shard_key,
                replicas,
                min_in_sync,
                fields,
                quantization,
                vectors_on_disk,
            } => {
                let metric: Metric = metric.parse()?;
                let mut spec = CollectionSpec::new(name, dimension)
                    .metric(metric)
                    .quantization(quantization.parse()?)
                    .vectors_on_disk(vectors_on_disk)
                    .hnsw(m, ef_construction, ef_search)
                    .shards(shards, shard_key.parse()?)
                    .replicas(replicas, min_in_sync);
                for field in &fields {
                    let (name, field_type) = parse_field(field)?;
                    spec = spec.field(name, field_type);
                }
                if let Some(d) = durability(Some(&d))? {
                    spec = spec.default_durability(d);
                }
                let info = connect(&client).await?.create_collection(spec).await?;
                print_info(&info);
            }
            CollectionCommand::AddField {
                client,
                name,
                fields,
            } => {
                let fields = fields
                    .iter()
                    .map(|f| parse_field(f))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let info = connect(&client).await?.add_fields(&name, fields).await?;
                print_info(&info);
            }
            CollectionCommand::List { client } => {
                for name in connect(&client).await?.list_collections().await? {
                    println!("{name}");
                }
            }
            CollectionCommand::Info { client, name } => {
                let info = connect(&client).await?.collection_info(&name).await?;
                print_info(&info);
            }
            CollectionCommand::Drop { client, name } => {
                connect(&client).await?.drop_collection(&name).await?;
                println!("dropped {name}");
            }
        },
        Command::Insert(args) => insert(args).await?,
        Command::Bench(command) => crate::bench::run(command).await?,
        Command::Snapshot(command) => crate::backup::run(command).await?,
        Command::Cluster(ClusterCommand::Forget {
            client,
            node_id,
            yes,
        }) => {
            let report = connect(&client)
                .await?
                .forget_node_report(&node_id, yes)
                .await?;
            let shards = &report.given_up;
            for shard in &report.kept {
                println!(
                    "{} shard {} of collection {}: no data lost, its primary is {} (epoch {}), \
                     in sync: {}",
                    if yes { "kept" } else { "would keep" },
                    shard.shard,
                    shard.collection,
                    shard.node_id,
                    shard.epoch,
                    shard.in_sync.join(", ")
                );
            }
            for shard in &report.set_aside {
                println!(
                    "{} shard {} of collection {}: no other in-sync copy is alive, so {node_id}'s \
                     copy leaves the record and is set aside (never deleted) should the node come \
                     back; the shard waits for its primary {} (epoch {})",
                    if yes { "set aside" } else { "would set aside" },
                    shard.shard,
                    shard.collection,
                    shard.node_id,
                    shard.epoch
                );
            }
            if shards.is_empty() {
                println!("node {node_id} holds no shard data that is not also elsewhere: nothing to give up");
            }
            for shard in shards {
                println!(
                    "{} shard {} of collection {}: its data on {node_id} is {}; it {} empty on {} (epoch {})",
                    if yes { "gave up" } else { "would give up" },
                    shard.shard,
                    shard.collection,
                    if yes { "lost" } else { "to be lost" },
                    if yes { "starts" } else { "would start" },
                    shard.node_id,
                    shard.epoch
                );
            }
            if !yes && !shards.is_empty() {
                println!("nothing changed: run again with --yes to give this data up for good");
            }
        }
        Command::Cluster(ClusterCommand::Drain {
            client,
            node_id,
            cancel,
            no_wait,
        }) => {
            let client = connect(&client).await?;
            let left = client.drain_node(&node_id, cancel).await?;
            if cancel {
                println!("node {node_id} is no longer draining ({left} shards on it)");
            } else if no_wait || left == 0 {
                println!("node {node_id} is draining: {left} shards to move off it");
            } else {
                println!("node {node_id} is draining: {left} shards to move off it; waiting");
                let mut last = left as usize;
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                    let status = client.cluster_status().await?;
                    // Its shards and its replica copies (which move off it too).
                    let owned = status
                        .shards
                        .iter()
                        .filter(|s| s.node_id == node_id || s.replicas.contains(&node_id))
                        .count();
                    if owned != last {
                        println!("{owned} shards left on {node_id}");
                        last = owned;
                    }
                    if owned == 0 {
                        println!("node {node_id} holds no shard copy: it can be stopped");
                        break;
                    }
                }
            }
        }
        Command::Cluster(ClusterCommand::Status { client, json }) => {
            let status = connect(&client).await?.cluster_status().await?;
            let status = with_replication_lag(status, &client).await;
            print_cluster_status(&status, json);
        }
        Command::Cluster(ClusterCommand::SetAside(SetAsideCommand::List { client })) => {
            let shards = connect(&client).await?.list_set_aside().await?;
            if shards.is_empty() {
                println!("no set-aside shard copies on this node");
            }
            for shard in shards {
                println!("{}\t{} bytes\t{}", shard.name, shard.bytes, shard.reason);
            }
        }
        Command::Cluster(ClusterCommand::SetAside(SetAsideCommand::Drop { client, name })) => {
            connect(&client).await?.drop_set_aside(&name).await?;
            println!("dropped set-aside copy {name}");
        }
        Command::Cluster(ClusterCommand::SetAside(SetAsideCommand::Import {
            client,
            name,
            into,
        })) => {
            let collection = match into {
                Some(collection) => collection,
                None => name
                    .split_once('.')
                    .map(|(collection, _)| collection.to_owned())
                    .context("the copy's name does not say its collection: pass --into")?,
            };
            let n = connect(&client)
                .await?
                .import_set_aside(&name, &collection)
                .await?;
            println!("imported {n} documents from {name} into {collection} (the copy stays: drop it once checked)");
        }
        Command::Search(args) => search(args).await?,
        Command::Get {
            client,
            collection,
            user_id,
            doc_ids,
            with_payload,
        } => {
            let docs = connect(&client)
                .await?
                .get_selected(
                    &collection,
                    user_id,
                    &doc_ids,
                    &[],
                    with_payload,
                    &tarn_client::ReadToken::default(),
                )
                .await?;
            for doc in docs {
                let mut line = format!("{}\t{:?}", doc.doc_id, doc.vector);
                if !doc.attributes.is_empty() {
                    line += &format!("\t{}", attributes_json(&doc.attributes));
                }
                if let Some(payload) = doc.attributes.payload() {
                    line += &format!("\t{payload}");
                }
                println!("{line}");
            }
        }
        Command::Count {
            client,
            collection,
            user_ids,
            filter,
        } => {
            let client = connect(&client).await?;
            let mut count = tarn_client::Count::new(collection.clone()).users(user_ids);
            if let Some(text) = filter {
                count = count.filter(parse_filter(&client, &collection, &text).await?);
            }
            println!("{}", client.count(count).await?);
        }
        Command::Scroll {
            client,
            collection,
            user_ids,
            filter,
            page,
            with_vectors,
            with_payload,
        } => {
            let client = connect(&client).await?;
            let filter = match filter {
                Some(text) => Some(parse_filter(&client, &collection, &text).await?),
                None => None,
            };
            let mut cursor = Vec::new();
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            loop {
                let mut scroll = tarn_client::Scroll::new(collection.clone())
                    .users(user_ids.clone())
                    .limit(page)
                    .cursor(cursor)
                    .vectors(with_vectors)
                    .payload(with_payload);
                if let Some(filter) = &filter {
                    scroll = scroll.filter(filter.clone());
                }
                let page = client.scroll(scroll).await?;
                for doc in &page.docs {
                    let mut line = serde_json::json!({
                        "doc_id": doc.doc_id.to_string(),
                        "user_id": doc.user_id.to_string(),
                        "attributes": attributes_json(&doc.attributes),
                    });
                    if with_vectors {
                        line["vector"] = serde_json::json!(doc.vector);
                    }
                    if let Some(payload) = doc.attributes.payload() {
                        line["payload"] = serde_json::from_str(payload)?;
                    }
                    writeln!(out, "{line}")?;
                }
                match page.next {
                    Some(next) => cursor = next,
                    None => break,
                }
            }
            out.flush()?;
        }
        Command::Remove {
            client,
            collection,
            user_ids,
            doc_ids,
            filter,
        } => {
            let client = connect(&client).await?;
            match filter {
                Some(text) => {
                    let filter = parse_filter(&client, &collection, &text).await?;
                    let ack = client
                        .remove(Remove::matching(collection, filter).users(user_ids))
                        .await?;
                    println!(
                        "removed {} documents (seq_no {})",
                        ack.n_written, ack.seq_no
                    );
                }
                None => {
                    let ack = client
                        .remove(Remove::new(collection, doc_ids).users(user_ids))
                        .await?;
                    println!("seq_no {}", ack.seq_no);
                }
            }
        }
        Command::Flush { client, collection } => {
            let flushed = connect(&client).await?.flush(&collection).await?;
            println!("flushed_seq_no {flushed}");
        }
    }
    Ok(())
}

/// Sends `requests` (each with its number of documents), `concurrency` at a time, showing
/// progress over `n_rows` documents; the highest sequence number acknowledged.
async fn send_inserts(
    client: &Client,
    requests: impl IntoIterator<Item = (Insert, usize)>,
    n_rows: usize,
    concurrency: usize,
) -> anyhow::Result<u64> {
    let progress = indicatif::ProgressBar::new(n_rows as u64);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} vectors {per_sec} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let limit = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    let mut last_seq = 0;
    for (request, n_docs) in requests {
        let permit = Arc::clone(&limit).acquire_owned().await?;
        let (client, progress) = (client.clone(), progress.clone());
        tasks.spawn(async move {
            let reply = client.insert(request).await;
            drop(permit);
            progress.inc(n_docs as u64);
            reply.map(|ack| ack.seq_no)
        });
        while let Some(done) = tasks.try_join_next() {
            last_seq = last_seq.max(done??);
        }
    }
    while let Some(done) = tasks.join_next().await {
        last_seq = last_seq.max(done??);
    }
    progress.finish_and_clear();
    Ok(last_seq)
}

async fn insert(args: InsertArgs) -> anyhow::Result<()> {
    let client = connect(&args.client).await?;
    let durability = durability(args.durability.as_deref())?;
    let batch = args.batch.max(1);
    let started = Instant::now();
    let with_durability = |request: Insert| match durability {
        Some(durability) => request.durability(durability),
        None => request,
    };
    let (n_rows, last_seq) = match (&args.jsonl, &args.fvecs) {
        (Some(path), _) => {
            let info = client.collection_info(&args.collection).await?;
            let docs = read_documents_jsonl(path, args.limit, &info.fields)?;
            if let Some(doc) = docs
                .iter()
                .find(|d| d.vector.len() != info.dimension as usize)
            {
                bail!(
                    "{}: document {} has {} values, the collection's vectors {}",
                    path.display(),
                    doc.doc_id,
                    doc.vector.len(),
                    info.dimension
                );
            }
            // Consecutive documents of the same tenant, `batch` to a request.
            let mut requests = Vec::new();
            for tenant in docs.chunk_by(|a, b| a.user_id == b.user_id) {
                for part in tenant.chunks(batch) {
                    let users = part[0].user_id.map_or(args.user_ids.clone(), |u| vec![u]);
                    let vectors: Vec<f32> = part.iter().flat_map(|d| d.vector.clone()).collect();
                    let request = Insert::new(
                        args.collection.clone(),
                        part.iter().map(|d| d.doc_id).collect::<Vec<_>>(),
                        vectors,
                    )
                    .users(users);
                    let request = match part.iter().any(|d| !d.attributes.is_empty()) {
                        true => request.attributes(part.iter().map(|d| d.attributes.clone())),
                        false => request,
                    };
                    requests.push((with_durability(request), part.len()));
                }
            }
            let last_seq = send_inserts(&client, requests, docs.len(), args.concurrency).await?;
            (docs.len(), last_seq)
        }
        (None, Some(fvecs)) => {
            let (dim, words) = read_vecs_rows(fvecs, args.limit)?;
            let vectors: Vec<f32> = words.into_iter().map(f32::from_bits).collect();
            let n_rows = vectors.len() / dim.max(1);
            let attributes = match &args.attributes {
                Some(path) => {
                    let info = client.collection_info(&args.collection).await?;
                    read_attributes(path, n_rows, &info.fields)?
                }
                None => Vec::new(),
            };
            // Each request is made when a slot frees up: the vectors are not copied ahead.
            let requests = (0..n_rows).step_by(batch).map(|start| {
                let end = (start + batch).min(n_rows);
                let doc_ids: Vec<u128> = (start..end).map(|r| args.first_id + r as u128).collect();
                let mut request = Insert::new(
                    args.collection.clone(),
                    doc_ids,
                    &vectors[start * dim..end * dim],
                )
                .users(args.user_ids.clone());
                if !attributes.is_empty() {
                    request = request.attributes(attributes[start..end].iter().cloned());
                }
                (with_durability(request), end - start)
            });
            let last_seq = send_inserts(&client, requests, n_rows, args.concurrency).await?;
            (n_rows, last_seq)
        }
        (None, None) => bail!("give --fvecs or --jsonl"),
    };
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "inserted {n_rows} vectors in {elapsed:.2} s: {:.0} vectors/s (last seq_no {last_seq})",
        n_rows as f64 / elapsed
    );
    if !args.no_wait {
        wait_until_indexed(&client, &args.collection).await?;
        println!(
            "indexed: nothing left to scan exactly {:.2} s after the first write",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Shows indexing progress until every appended operation is applied and no stored vector
/// waits for a graph (`n_unindexed`).
async fn wait_until_indexed(client: &Client, collection: &str) -> anyhow::Result<()> {
    let progress = indicatif::ProgressBar::new_spinner();
    progress.set_style(
        indicatif::ProgressStyle::with_template("{spinner} indexing: {msg} ({elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    loop {
        let info = client.collection_info(collection).await?;
        if info.n_unindexed == 0 && info.applied_seq_no >= info.last_seq_no {
            break;
        }
        progress.set_message(format!(
            "{} vectors wait for a graph, {} operations to apply",
            info.n_unindexed,
            info.last_seq_no.saturating_sub(info.applied_seq_no)
        ));
        progress.tick();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    progress.finish_and_clear();
    Ok(())
}

/// One hit as `tarn search --text` prints it: doc id, tenant, score, the selected fields as
/// JSON, the payload.
fn print_hit(hit: &tarn_client::Hit) {
    let mut line = format!("{}\t{}\t{}", hit.doc_id, hit.user_id, hit.score);
    if !hit.attributes.is_empty() {
        line += &format!("\t{}", attributes_json(&hit.attributes));
    }
    if let Some(payload) = hit.attributes.payload() {
        line += &format!("\t{payload}");
    }
    println!("{line}");
}

async fn search(args: SearchArgs) -> anyhow::Result<()> {
    let text = args.text.clone().zip(args.text_field.clone());
    let Some(fvecs) = &args.fvecs else {
        // A full-text search (clap requires --text without --fvecs).
        let Some((query, field)) = text else {
            bail!("--fvecs or --text is needed");
        };
        let client = connect(&args.client).await?;
        let mut search = Search::text(args.collection.as_str(), field, query)
            .users(args.user_ids.clone())
            .top_k(args.top_k)
            .output_fields(args.output_fields.clone())
            .with_payload(args.with_payload);
        if let Some(text) = &args.filter {
            search = search.filter(parse_filter(&client, &args.collection, text).await?);
        }
        for hit in client.search(search).await? {
            print_hit(&hit);
        }
        return Ok(());
    };
    let (dim, words) = read_vecs_rows(fvecs, args.limit)?;
    let queries: Vec<f32> = words.into_iter().map(f32::from_bits).collect();
    let truth = match &args.ivecs {
        Some(path) => Some(read_vecs_rows(path, args.limit)?),
        None => None,
    };
    let client = connect(&args.client).await?;
    let filter = match &args.filter {
        Some(text) => Some(parse_filter(&client, &args.collection, text).await?),
        None => None,
    };
    let k = args.top_k as usize;
    let request = |vector: &[f32]| {
        let search = match &text {
            Some((query, field)) => Search::hybrid(
                args.collection.as_str(),
                vector,
                field.as_str(),
                query.as_str(),
            ),
            None => Search::new(args.collection.as_str(), vector),
        };
        let search = search
            .users(args.user_ids.clone())
            .top_k(args.top_k)
            .ef(args.ef)
            .exact(args.exact);
        match &filter {
            Some(filter) => search.filter(filter.clone()),
            None => search,
        }
    };
    for vector in queries.chunks_exact(dim).take(args.warmup) {
        client.search(request(vector)).await?;
    }
    let mut latencies = Vec::new();
    let (mut found, mut expected) = (0usize, 0usize);
    let started = Instant::now();
    for (q, vector) in queries.chunks_exact(dim).enumerate() {
        let t = Instant::now();
        let hits = client.search(request(vector)).await?;
        latencies.push(t.elapsed().as_secs_f64() * 1e3);
        let ids: Vec<u128> = hits.iter().map(|h| h.doc_id).collect();
        if args.verbose {
            println!(
                "query {q}: {:?}",
                hits.iter().map(|h| (h.doc_id, h.score)).collect::<Vec<_>>()
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
        bail!("no queries in {}", fvecs.display());
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
