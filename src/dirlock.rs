//! One owner per data directory (decision 0030): a serving process holds an exclusive lock on
//! its data directory (the disk tier, the local socket, the usage files) and on its usage
//! spool's directory where that lies elsewhere, from start to exit. A second process on a
//! held directory refuses to start and names the holder. The lock is the kernel's (`flock` on
//! `<dir>/cachet.lock`), so it dies with its process, kill -9 included; the file's text only
//! says who holds it.

use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// The lock file in each held directory.
pub const LOCK_FILE: &str = "cachet.lock";

/// A held directory; the lock goes when this is dropped or the process ends.
#[derive(Debug)]
pub struct DirLock {
    _file: std::fs::File,
    dir: PathBuf,
}

impl DirLock {
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Hold `dir` (made if missing) for a process in `role` (`serve`, `node n1`, …), or say who
/// holds it.
pub fn hold(dir: &Path, role: &str) -> anyhow::Result<DirLock> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the data directory {}", dir.display()))?;
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            bail!(
                "the directory {} is in use by another Cachet process ({}); give each process \
                 its own data directory (data_dir, CACHET_DATA_DIR) and usage spool",
                dir.display(),
                if holder.is_empty() {
                    "it has not said who it is yet".to_string()
                } else {
                    holder.to_string()
                }
            );
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("locking {}", path.display()));
        }
    }
    let who = format!(
        "pid {}, cachet {role}, since {}",
        std::process::id(),
        chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ")
    );
    file.set_len(0)?;
    file.rewind()?;
    file.write_all(format!("{who}\n").as_bytes())?;
    file.sync_data()?;
    tracing::debug!(dir = %dir.display(), "holding the directory");
    Ok(DirLock {
        _file: file,
        dir: dir.to_path_buf(),
    })
}

/// Hold every directory of `dirs` (each once), or none.
pub fn hold_all(dirs: &[PathBuf], role: &str) -> anyhow::Result<Vec<DirLock>> {
    let mut held: Vec<DirLock> = Vec::new();
    for d in dirs {
        std::fs::create_dir_all(d)
            .with_context(|| format!("creating the directory {}", d.display()))?;
        let canonical = d.canonicalize()?;
        if held.iter().any(|h| h.dir == canonical) {
            continue;
        }
        held.push(hold(&canonical, role)?);
    }
    Ok(held)
}

/// The directories a process with this data directory and usage spool writes: the data
/// directory, and the spool's when it lies elsewhere.
pub fn meter_dirs(data_dir: &Path, spool_path: &Path) -> Vec<PathBuf> {
    let mut dirs = vec![data_dir.to_path_buf()];
    if let Some(spool_dir) = spool_path.parent().filter(|d| !d.as_os_str().is_empty()) {
        dirs.push(spool_dir.to_path_buf());
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch() -> PathBuf {
        let d = std::env::temp_dir().join(format!("cachet-dirlock-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_held_directory_is_refused_with_its_holder_named_and_free_once_dropped() {
        let d = scratch();
        let first = hold(&d, "serve").unwrap();
        let err = hold(&d, "node n1").unwrap_err().to_string();
        assert!(err.contains("in use by another Cachet process"), "{err}");
        assert!(
            err.contains(&format!("pid {}, cachet serve, since ", std::process::id())),
            "{err}"
        );
        drop(first);
        let again = hold(&d, "node n1").unwrap();
        let text = std::fs::read_to_string(d.join(LOCK_FILE)).unwrap();
        assert!(text.contains("cachet node n1"), "{text}");
        drop(again);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_spool_directory_is_held_too_and_each_directory_once() {
        let (data, spool) = (scratch(), scratch());
        let held = hold_all(
            &meter_dirs(&data, &spool.join("usage-spool.jsonl")),
            "serve",
        )
        .unwrap();
        assert_eq!(held.len(), 2);
        // Another process with its own data directory but the same spool is refused.
        let other = scratch();
        let err = hold_all(&meter_dirs(&other, &spool.join("x.jsonl")), "serve").unwrap_err();
        assert!(
            err.to_string().contains(&spool.display().to_string()),
            "{err}"
        );
        drop(held);
        // A spool inside the data directory: one lock.
        let held = hold_all(&meter_dirs(&data, &data.join("usage-spool.jsonl")), "serve").unwrap();
        assert_eq!(held.len(), 1);
        drop(held);
        for d in [data, spool, other] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}
