//! Helpers shared by the fabric's integration tests.

#![allow(dead_code)]

use cachet_common::{Scope, TenantId, WorkspaceId};

/// A fresh scope (tenant and workspace).
pub fn scope() -> Scope {
    Scope {
        tenant: TenantId::new(),
        workspace: WorkspaceId::new(),
    }
}

/// A temporary directory, removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new() -> Self {
        let p = std::env::temp_dir().join(format!("cachet-fabric-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
