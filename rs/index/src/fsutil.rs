//! Durable file writes: write a temp file, fsync it, rename it into place, fsync the directory.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;

/// fsyncs a directory so that creations, renames and deletions in it are durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Replaces `path` with `bytes` atomically and durably: after this returns, a crash leaves
/// either nothing (if `path` did not exist) or the complete new file, never a partial one.
pub fn write_durably(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let mut temp = path.as_os_str().to_owned();
    temp.push(".tmp");
    let temp = std::path::PathBuf::from(temp);
    {
        let mut file = File::create(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
    }
    fs::rename(&temp, path)?;
    sync_dir(dir)
}
