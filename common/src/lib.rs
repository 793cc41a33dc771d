//! Identifiers and small value types shared by every Cachet crate.
//!
//! Domain ids are newtypes so a tenant id can never be passed where a key id is expected.
//! This crate holds no logic beyond formatting and parsing those ids; it is not a place for
//! helpers that belong to one subsystem, and the one error vocabulary ([`error`]) every
//! crate's errors speak, the loop of every periodic background job ([`tick`]) and the one
//! way a metric is made and registered ([`metrics`]), and the stage load an engine measures
//! and a routing gateway weighs ([`stages`]), and the trace context a request carries between
//! processes (`trace`, feature `trace`).

pub mod error;
pub mod metrics;
#[cfg(feature = "http")]
pub mod span;
pub mod stages;
pub mod tick;
#[cfg(feature = "trace")]
pub mod trace;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

macro_rules! uuid_id {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub Uuid);

        impl $name {
            /// A fresh, time-ordered id.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }
            pub fn as_uuid(&self) -> Uuid {
                self.0
            }
        }
        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
        impl FromStr for $name {
            type Err = uuid::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map(Self)
            }
        }
        impl From<Uuid> for $name {
            fn from(u: Uuid) -> Self {
                Self(u)
            }
        }
    };
}

uuid_id!(
    /// A customer organisation; the unit of billing and quotas.
    TenantId
);
uuid_id!(
    /// The isolation scope inside a tenant; caches are never shared across workspaces.
    WorkspaceId
);
uuid_id!(
    /// One API key row.
    ApiKeyId
);

/// The id of one API request: the ledger's primary key and the `request-id` header.
///
/// Displayed as `req_` followed by 32 lowercase hex digits of a UUIDv7.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub Uuid);

impl RequestId {
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }
    /// The message id shown to the client for this request (`msg_…`).
    pub fn message_id(&self) -> String {
        format!("msg_{}", self.0.simple())
    }
}
impl Default for RequestId {
    fn default() -> Self {
        Self::new()
    }
}
impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req_{}", self.0.simple())
    }
}
impl FromStr for RequestId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s.strip_prefix("req_").unwrap_or(s)).map(Self)
    }
}

/// The isolation scope of cached KV: every block hash preimage carries it, so no tenant can
/// address another tenant's (or another workspace's) blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Scope {
    pub tenant: TenantId,
    pub workspace: WorkspaceId,
}

/// Hashes a [`BlockHash`] for hash maps by taking 8 of its bytes: they are SHA-256 output,
/// already uniform, so running them through SipHash again only costs time (the fabric looks
/// up hundreds of blocks per request). Only for maps keyed by `BlockHash` or by 8 bytes taken
/// from one (a `u64` key is hashed by identity). Flooding such a map
/// would take many hashes sharing 64 bits, i.e. SHA-256 multicollisions, and block hashes are
/// computed by the gateway, not chosen by clients.
#[derive(Default, Clone, Copy)]
pub struct BlockHasher(u64);

impl std::hash::Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        match bytes.get(..8) {
            Some(b) => self.0 ^= u64::from_le_bytes(b.try_into().expect("8 bytes")),
            // Not a block hash (e.g. a length prefix written as bytes): fold it in.
            None => {
                for b in bytes {
                    self.0 = self.0.rotate_left(8) ^ u64::from(*b);
                }
            }
        }
    }
    fn write_usize(&mut self, _len: usize) {
        // The slice length prefix of `[u8; 32]`: the same for every key.
    }
}

/// A hash map keyed by block hash, hashed with [`BlockHasher`].
pub type BlockMap<V> =
    std::collections::HashMap<BlockHash, V, std::hash::BuildHasherDefault<BlockHasher>>;
/// A hash set of block hashes, hashed with [`BlockHasher`].
pub type BlockSet =
    std::collections::HashSet<BlockHash, std::hash::BuildHasherDefault<BlockHasher>>;

/// A 32-byte SHA-256 block hash (see `cache_fabric::keys`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// The parent of the first block of every chain.
    pub const ZERO: BlockHash = BlockHash([0; 32]);
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
    /// The first 8 bytes as an integer: a cheap, well-mixed key for in-memory maps.
    pub fn prefix_u64(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes"))
    }
}
impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({})", &self.to_hex()[..16])
    }
}
impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Cache entry lifetime classes, as on the Anthropic API.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, ToSchema,
)]
pub enum Ttl {
    #[serde(rename = "5m")]
    FiveMinutes,
    #[serde(rename = "1h")]
    OneHour,
}

impl Ttl {
    pub fn duration(self) -> Duration {
        match self {
            Ttl::FiveMinutes => Duration::from_secs(300),
            Ttl::OneHour => Duration::from_secs(3600),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Ttl::FiveMinutes => "5m",
            Ttl::OneHour => "1h",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_id_round_trips_through_its_display_form() {
        let id = RequestId::new();
        let shown = id.to_string();
        assert!(shown.starts_with("req_") && shown.len() == 36);
        assert_eq!(shown.parse::<RequestId>().unwrap(), id);
        assert!(id.message_id().starts_with("msg_"));
    }

    #[test]
    fn ttl_orders_five_minutes_before_one_hour() {
        assert!(Ttl::FiveMinutes.duration() < Ttl::OneHour.duration());
        assert_eq!(Ttl::OneHour.as_str(), "1h");
    }
}

/// Marks an error response whose JSON body was made where the request id was not at hand:
/// the server's request middleware adds the id to the body (`request_id`) on its way out.
#[derive(Clone, Copy, Debug)]
pub struct RequestIdPending;
