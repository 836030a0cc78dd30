//! Test and benchmark helpers (never a dependency of the product): seeded clustered vectors, a
//! brute-force kNN oracle, readers for the TEXMEX fvecs/ivecs files of `../shared/data`, and
//! a lister for a collection's files.

use std::io;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use tarn_index::Metric;

/// `n` vectors of `dim` floats around `n_clusters` random centres (so that graphs have real
/// neighbourhoods to find), reproducible from `seed`. Row-major.
pub fn clustered_vectors(n: usize, dim: usize, n_clusters: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let centres: Vec<f32> = (0..n_clusters * dim)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut out = Vec::with_capacity(n * dim);
    for _ in 0..n {
        let c = rng.random_range(0..n_clusters);
        for d in 0..dim {
            out.push(centres[c * dim + d] + rng.random_range(-0.3..0.3));
        }
    }
    out
}

/// Exact k nearest rows of `base` to `query` under `metric` (vectors prepared as the index
/// prepares them), nearest first.
pub fn brute_force_top_k(
    base: &[f32],
    dim: usize,
    query: &[f32],
    k: usize,
    metric: Metric,
) -> Vec<usize> {
    let mut q = query.to_vec();
    metric.prepare(&mut q);
    let mut scored: Vec<(f32, usize)> = base
        .chunks_exact(dim)
        .enumerate()
        .map(|(i, row)| {
            let mut v = row.to_vec();
            metric.prepare(&mut v);
            (metric.distance(&q, &v), i)
        })
        .collect();
    scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    scored.into_iter().take(k).map(|(_, i)| i).collect()
}

/// Fraction of `truth`'s first `k` found in `found`.
pub fn recall(found: &[usize], truth: &[usize], k: usize) -> f64 {
    let truth = &truth[..k.min(truth.len())];
    let hits = found.iter().take(k).filter(|f| truth.contains(f)).count();
    hits as f64 / truth.len().max(1) as f64
}

/// Reads an fvecs file: returns (dimension, row-major values).
pub fn read_fvecs(path: &Path) -> io::Result<(usize, Vec<f32>)> {
    let bytes = std::fs::read(path)?;
    let (dim, words) = read_vecs(&bytes, path)?;
    Ok((dim, words.into_iter().map(f32::from_bits).collect()))
}

/// Reads an ivecs file: returns (dimension, row-major values).
pub fn read_ivecs(path: &Path) -> io::Result<(usize, Vec<i32>)> {
    let bytes = std::fs::read(path)?;
    let (dim, words) = read_vecs(&bytes, path)?;
    Ok((dim, words.into_iter().map(|w| w as i32).collect()))
}

fn read_vecs(bytes: &[u8], path: &Path) -> io::Result<(usize, Vec<u32>)> {
    let bad = |why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {why}", path.display()),
        )
    };
    if bytes.len() < 4 {
        return Err(bad("empty"));
    }
    let dim = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes")) as usize;
    let row = 4 + dim * 4;
    if dim == 0 || !bytes.len().is_multiple_of(row) {
        return Err(bad("not a whole number of rows"));
    }
    let mut out = Vec::with_capacity(bytes.len() / row * dim);
    for chunk in bytes.chunks_exact(row) {
        if u32::from_le_bytes(chunk[0..4].try_into().expect("4 bytes")) as usize != dim {
            return Err(bad("rows of different dimensions"));
        }
        out.extend(
            chunk[4..]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))),
        );
    }
    Ok((dim, out))
}

/// `../shared/data/minilm-debian` beside the repository, if present (tests that need it skip
/// themselves, saying so, when it is not).
pub fn minilm_dir() -> Option<PathBuf> {
    let dir = match std::env::var_os("TARN_MINILM_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/minilm-debian"),
    };
    dir.join("base.fvecs").exists().then_some(dir)
}

/// The minilm-debian evaluation set, as the benchmarks use it.
#[derive(Debug)]
pub struct Minilm {
    pub dim: usize,
    /// Row after row.
    pub base: Vec<f32>,
    pub queries: Vec<f32>,
    /// `truth_width` exact nearest base rows per query, best first.
    pub truth: Vec<i32>,
    pub truth_width: usize,
}

impl Minilm {
    /// The queries one by one, each passed through `prepare` (the metric's preparation, e.g.
    /// unit length for cosine).
    pub fn prepared_queries(&self, prepare: impl Fn(&mut [f32])) -> Vec<Vec<f32>> {
        self.queries
            .chunks_exact(self.dim)
            .map(|q| {
                let mut v = q.to_vec();
                prepare(&mut v);
                v
            })
            .collect()
    }

    /// Mean recall@k of `found` (per query, in query order, the ids of its hits: base row
    /// numbers) against the exact truth.
    pub fn recall_at(&self, k: usize, found: impl IntoIterator<Item = Vec<u128>>) -> f64 {
        let (mut hits, mut n_queries) = (0usize, 0usize);
        for (q, ids) in found.into_iter().enumerate() {
            let truth = &self.truth[q * self.truth_width..][..k];
            hits += ids
                .iter()
                .filter(|&&id| truth.contains(&(id as i32)))
                .count();
            n_queries += 1;
        }
        hits as f64 / (n_queries.max(1) * k) as f64
    }
}

/// Reads base vectors, queries and ground truth from a minilm-debian directory.
pub fn load_minilm(dir: &Path) -> io::Result<Minilm> {
    let (dim, base) = read_fvecs(&dir.join("base.fvecs"))?;
    let (_, queries) = read_fvecs(&dir.join("query.fvecs"))?;
    let (truth_width, truth) = read_ivecs(&dir.join("groundtruth.ivecs"))?;
    Ok(Minilm {
        dim,
        base,
        queries,
        truth,
        truth_width,
    })
}

/// The files in `dir` whose names start with `prefix` (for example a collection's
/// `MANIFEST-` files), sorted by path, so the newest generation comes last.
pub fn files_starting_with(dir: &Path, prefix: &str) -> io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(prefix))
        {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}
