//! Which database a directory's usage files belong to (decision 0030).
//!
//! The database gets an identity when its schema is first applied (`database_identity`,
//! migration 0011). A meter's files lie in one directory, beside its spool: the spool, the
//! usage journal's segments, the open-stream journal and the rejected rows, all named
//! `<spool stem>.*`. That directory records the identity of the database its files belong to
//! in [`IDENTITY_FILE`], written the first time a meter starts there.
//!
//! A meter that finds another database's identity never replays those files here. By
//! default ([`Foreign::KeepAside`], a serving process) it moves them, with their identity
//! file, to `kept-aside/<their identity>-<unix time>/` in the same directory, logs it, and
//! counts the kept-aside directories in `cachet_billing_meter_kept_aside`; `cachet billing
//! recover --data-dir <that directory>` replays them into the database they belong to.
//! [`Foreign::Refuse`] (recovery itself) refuses to start instead: the operator pointed at the
//! wrong database.
//!
//! A directory whose files predate identities (no identity file) is adopted by the first
//! database that starts a meter there, with a warning: nothing tells whose they were.

use std::path::{Path, PathBuf};

use sqlx::PgPool;
use uuid::Uuid;

use crate::metrics;

/// The file, in a meter's directory, that names the database its files belong to.
pub const IDENTITY_FILE: &str = "database-id";
/// Where another database's files are moved, under the meter's directory.
pub const KEPT_ASIDE: &str = "kept-aside";

/// What a meter does with files of another database in its directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Foreign {
    /// Move them aside and start with an empty directory (serving processes).
    KeepAside,
    /// Refuse to start (recovering a directory into a database).
    Refuse,
}

#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("reading the database's identity: {0}")]
    Identity(#[from] sqlx::Error),
    #[error(
        "the usage files in {} belong to database {theirs}, not to this one ({ours}); \
         recover them with the database_url of the database they belong to",
        dir.display()
    )]
    Foreign {
        dir: PathBuf,
        theirs: Uuid,
        ours: Uuid,
    },
    #[error("{} holds an unreadable database identity ({why}); move it aside to start", path.display())]
    Unreadable { path: PathBuf, why: String },
    #[error("usage files in {}: {source}", dir.display())]
    Io {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// The database's identity (made by the migrations).
pub async fn identity(pool: &PgPool) -> Result<Uuid, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM database_identity")
        .fetch_one(pool)
        .await
}

/// What [`claim`] found in the directory.
#[derive(Debug, PartialEq, Eq)]
pub enum Claimed {
    /// The directory already belonged to this database.
    Ours,
    /// It had no identity yet (new, or files from before identities): it has this one now.
    Marked { files: usize },
    /// Another database's files were moved to `to`.
    KeptAside {
        theirs: Uuid,
        to: PathBuf,
        files: usize,
    },
}

/// The directory of `spool_path`, made to belong to `database` before the meter reads
/// anything in it.
pub fn claim(spool_path: &Path, database: Uuid, foreign: Foreign) -> Result<Claimed, ClaimError> {
    let dir = match spool_path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(d) => d.to_path_buf(),
        None => PathBuf::from("."),
    };
    let io = |source| ClaimError::Io {
        dir: dir.clone(),
        source,
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    let claimed = match read_identity(&dir)? {
        Some(theirs) if theirs == database => Claimed::Ours,
        Some(theirs) => {
            if foreign == Foreign::Refuse {
                return Err(ClaimError::Foreign {
                    dir,
                    theirs,
                    ours: database,
                });
            }
            let files = meter_files(&dir, spool_path).map_err(io)?;
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs();
            let to = dir.join(KEPT_ASIDE).join(format!("{theirs}-{stamp}"));
            keep_aside(&dir, &files, &to).map_err(io)?;
            tracing::error!(
                dir = %dir.display(),
                %theirs,
                ours = %database,
                files = files.len(),
                kept_aside = %to.display(),
                "usage files of another database found: kept aside, not replayed into this \
                 one (`cachet billing recover --data-dir` replays them into theirs)"
            );
            write_identity(&dir, database).map_err(io)?;
            Claimed::KeptAside {
                theirs,
                to,
                files: files.len(),
            }
        }
        None => {
            let files = meter_files(&dir, spool_path).map_err(io)?;
            if !files.is_empty() {
                tracing::warn!(
                    dir = %dir.display(),
                    files = files.len(),
                    database = %database,
                    "usage files without a database identity (written before identities): \
                     taken as this database's"
                );
            }
            write_identity(&dir, database).map_err(io)?;
            Claimed::Marked { files: files.len() }
        }
    };
    metrics::KEPT_ASIDE.set(kept_aside_count(&dir) as i64);
    Ok(claimed)
}

fn read_identity(dir: &Path) -> Result<Option<Uuid>, ClaimError> {
    let path = dir.join(IDENTITY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(s) => s
            .trim()
            .parse()
            .map(Some)
            .map_err(|e: uuid::Error| ClaimError::Unreadable {
                path,
                why: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ClaimError::Io {
            dir: dir.to_path_buf(),
            source,
        }),
    }
}

/// Written whole or not at all: a temporary file renamed over, the directory synced.
fn write_identity(dir: &Path, database: Uuid) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!("{IDENTITY_FILE}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    writeln!(f, "{database}")?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(IDENTITY_FILE))?;
    crate::journal::sync_dir(dir)
}

/// The meter's files in `dir`: the spool itself and every `<spool stem>.*` beside it.
fn meter_files(dir: &Path, spool_path: &Path) -> std::io::Result<Vec<PathBuf>> {
    let name = spool_path
        .file_name()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    let stem = spool_path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("usage");
    let prefix = format!("{stem}.");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let n = entry.file_name();
        let Some(n) = n.to_str() else { continue };
        if (n == name || n.starts_with(&prefix)) && entry.file_type()?.is_file() {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

/// Move `files` and the identity file into `to` (made new), durably: the new directory's
/// entries synced before the old directory's.
fn keep_aside(dir: &Path, files: &[PathBuf], to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for f in files
        .iter()
        .cloned()
        .chain(std::iter::once(dir.join(IDENTITY_FILE)))
    {
        if let Some(name) = f.file_name() {
            std::fs::rename(&f, to.join(name))?;
        }
    }
    crate::journal::sync_dir(to)?;
    if let Some(parent) = to.parent() {
        crate::journal::sync_dir(parent)?;
    }
    crate::journal::sync_dir(dir)
}

/// How many kept-aside directories wait in `dir` for someone to recover them.
pub fn kept_aside_count(dir: &Path) -> usize {
    std::fs::read_dir(dir.join(KEPT_ASIDE))
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.path().is_dir())
                .count()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intents::tests::Dir;

    fn touch(p: &Path, body: &str) {
        std::fs::write(p, body).unwrap();
    }

    #[test]
    fn a_new_directory_is_marked_and_then_ours() {
        let d = Dir::new();
        let spool = d.path().join("usage-spool.jsonl");
        let a = Uuid::new_v4();
        assert_eq!(
            claim(&spool, a, Foreign::KeepAside).unwrap(),
            Claimed::Marked { files: 0 }
        );
        assert_eq!(claim(&spool, a, Foreign::Refuse).unwrap(), Claimed::Ours);
    }

    #[test]
    fn another_databases_files_are_kept_aside_with_their_identity() {
        let d = Dir::new();
        let spool = d.path().join("usage-spool.jsonl");
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        claim(&spool, a, Foreign::KeepAside).unwrap();
        for f in [
            "usage-spool.jsonl",
            "usage-spool.journal.3",
            "usage-spool.open",
            "usage-spool.rejected",
        ] {
            touch(&d.path().join(f), "{}\n");
        }
        touch(&d.path().join("other.txt"), "not the meter's");
        let err = claim(&spool, b, Foreign::Refuse).unwrap_err();
        assert!(
            matches!(err, ClaimError::Foreign { theirs, ours, .. } if theirs == a && ours == b),
            "{err}"
        );
        let Claimed::KeptAside { theirs, to, files } =
            claim(&spool, b, Foreign::KeepAside).unwrap()
        else {
            panic!("kept aside")
        };
        assert_eq!((theirs, files), (a, 4));
        assert!(to.starts_with(d.path().join(KEPT_ASIDE)));
        // Everything of the meter moved, with a's identity; the rest stays.
        for f in [
            "usage-spool.jsonl",
            "usage-spool.journal.3",
            "usage-spool.open",
        ] {
            assert!(!d.path().join(f).exists(), "{f} moved");
            assert!(to.join(f).exists(), "{f} kept");
        }
        assert!(d.path().join("other.txt").exists());
        assert_eq!(read_identity(&to).unwrap(), Some(a));
        assert_eq!(read_identity(d.path()).unwrap(), Some(b));
        assert_eq!(kept_aside_count(d.path()), 1);
        // The kept-aside directory is a's to recover: a claims it, b may not.
        let there = to.join("usage-spool.jsonl");
        assert!(claim(&there, b, Foreign::Refuse).is_err());
        assert_eq!(claim(&there, a, Foreign::Refuse).unwrap(), Claimed::Ours);
    }

    #[test]
    fn files_from_before_identities_are_adopted_and_a_damaged_identity_refused() {
        let d = Dir::new();
        let spool = d.path().join("usage-spool.jsonl");
        touch(&d.path().join("usage-spool.journal.0"), "{}\n");
        let a = Uuid::new_v4();
        assert_eq!(
            claim(&spool, a, Foreign::KeepAside).unwrap(),
            Claimed::Marked { files: 1 }
        );
        touch(&d.path().join(IDENTITY_FILE), "not a uuid");
        assert!(matches!(
            claim(&spool, a, Foreign::KeepAside),
            Err(ClaimError::Unreadable { .. })
        ));
    }
}
