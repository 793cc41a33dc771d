//! Admin identity: who is calling the admin and finance APIs, and in what role.
//!
//! Exposes [`Role`], the token [`Claims`], [`Jwt`] (signs and checks HS256 tokens with the
//! secret from `CACHET_ADMIN_JWT_SECRET`) and [`AdminAuth`], which authenticates a request's
//! `Authorization: Bearer` token and, for a token of an admin session, asks the control
//! plane whether the session is still live ([`Sessions`]). It reads no table. It sits below both billing (the finance API) and the control plane (the
//! admin API), which share these tokens; it is not where users, logins or sessions are
//! managed (that is the control plane).

use std::sync::Arc;

use axum::http::{HeaderMap, header};
use cachet_common::error::{ApiError, ErrorCode, ServiceError};
use chrono::Utc;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

/// A finance API role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    PlatformAdmin,
    Finance,
    TenantAdmin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::PlatformAdmin => "platform_admin",
            Role::Finance => "finance",
            Role::TenantAdmin => "tenant_admin",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Role::PlatformAdmin, Role::Finance, Role::TenantAdmin]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
}

/// The token's claims.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Claims {
    pub sub: String,
    pub role: Role,
    /// The tenant a `tenant_admin` administers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<Uuid>,
    /// The admin session (login) the token belongs to: it stops working when the session is
    /// logged out or its user disabled. Tokens made by `cachet billing token` have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sid: Option<Uuid>,
    pub exp: u64,
    /// Not valid before (seconds since the epoch); checked.
    #[serde(default)]
    pub nbf: u64,
}

/// What can go wrong with admin identity.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// A secret or a token request that cannot be honoured.
    #[error("{0}")]
    Invalid(String),
    /// A token that is missing, malformed, expired or of an ended session.
    #[error("{0}")]
    Unauthenticated(String),
    /// The admin APIs are off (no secret configured).
    #[error("the admin and finance APIs are off: set CACHET_ADMIN_JWT_SECRET")]
    Off,
    /// The sessions could not be read (their store's error, said).
    #[error("database: {0}")]
    Db(String),
}

impl ServiceError for IdentityError {
    fn error_code(&self) -> ErrorCode {
        match self {
            IdentityError::Invalid(_) => ErrorCode::InvalidRequest,
            IdentityError::Unauthenticated(_) => ErrorCode::Authentication,
            IdentityError::Off => ErrorCode::Unavailable,
            IdentityError::Db(_) => ErrorCode::Api,
        }
    }
}

impl From<IdentityError> for ApiError {
    fn from(e: IdentityError) -> Self {
        ApiError::from_service("admin authentication", &e)
    }
}

/// Signs and checks admin tokens.
#[derive(Clone)]
pub struct Jwt {
    encoding: EncodingKey,
    decoding: DecodingKey,
}

impl Jwt {
    /// At least 32 bytes of secret.
    pub fn new(secret: &[u8]) -> Result<Self, IdentityError> {
        if secret.len() < 32 {
            return Err(IdentityError::Invalid(
                "the admin JWT secret must be at least 32 bytes".into(),
            ));
        }
        Ok(Self {
            encoding: EncodingKey::from_secret(secret),
            decoding: DecodingKey::from_secret(secret),
        })
    }

    /// A token for `role` (and `tenant`, for a tenant admin) valid for `ttl`.
    pub fn issue(
        &self,
        sub: &str,
        role: Role,
        tenant: Option<Uuid>,
        ttl: std::time::Duration,
    ) -> Result<String, IdentityError> {
        self.issue_for_session(sub, role, tenant, None, ttl)
    }

    /// A token of an admin session `sid` (see [`Claims::sid`]).
    pub fn issue_for_session(
        &self,
        sub: &str,
        role: Role,
        tenant: Option<Uuid>,
        sid: Option<Uuid>,
        ttl: std::time::Duration,
    ) -> Result<String, IdentityError> {
        if (role == Role::TenantAdmin) != tenant.is_some() {
            return Err(IdentityError::Invalid(
                "a tenant_admin token names exactly one tenant; other roles name none".into(),
            ));
        }
        let now = Utc::now();
        let exp = (now + chrono::Duration::from_std(ttl).unwrap_or_default()).timestamp();
        let claims = Claims {
            sub: sub.to_string(),
            role,
            tenant,
            sid,
            exp: exp.max(0) as u64,
            nbf: now.timestamp().max(0) as u64,
        };
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .map_err(|e| IdentityError::Invalid(format!("signing the token: {e}")))
    }

    /// The claims of a token signed with this secret, unexpired and already valid.
    pub fn check(&self, token: &str) -> Result<Claims, IdentityError> {
        let mut v = Validation::new(Algorithm::HS256);
        v.leeway = 5;
        v.validate_nbf = true;
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &v)
            .map_err(|e| IdentityError::Unauthenticated(format!("invalid admin token: {e}")))?;
        let c = data.claims;
        if (c.role == Role::TenantAdmin) != c.tenant.is_some() {
            return Err(IdentityError::Unauthenticated(
                "invalid admin token: a tenant_admin token names exactly one tenant".into(),
            ));
        }
        Ok(c)
    }
}

/// Whether an admin session (a token's `sid`) is still live: not logged out, not expired, its
/// user not disabled. The sessions and users are the control plane's (its tables, its
/// logins); identity only asks, through this.
pub trait Sessions: Send + Sync {
    fn live(
        &self,
        sid: Uuid,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<bool, IdentityError>> + Send + '_>>;
}

/// Authenticates admin requests. Cheap to clone.
#[derive(Clone)]
pub struct AdminAuth {
    /// Asked about tokens that belong to an admin session.
    pub sessions: Arc<dyn Sessions>,
    /// `None`: the admin and finance APIs are off.
    pub jwt: Option<Arc<Jwt>>,
}

impl AdminAuth {
    /// A valid token in `Authorization: Bearer`, and, when it belongs to an admin session, a
    /// session that is neither logged out, expired, nor of a disabled user.
    /// A token naming a tenant names it on the request's span (`cachet_common::span`).
    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Claims, IdentityError> {
        let Some(jwt) = &self.jwt else {
            return Err(IdentityError::Off);
        };
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| {
                IdentityError::Unauthenticated(
                    "an admin token is required (Authorization: Bearer)".into(),
                )
            })?;
        let claims = jwt.check(token.trim())?;
        if let Some(t) = claims.tenant {
            cachet_common::span::record_tenant(cachet_common::TenantId(t), None);
        }
        if let Some(sid) = claims.sid
            && !self.sessions.live(sid).await?
        {
            return Err(IdentityError::Unauthenticated(
                "this admin session has ended: log in again".into(),
            ));
        }
        Ok(claims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_round_trips_and_a_tenant_admin_names_one_tenant() {
        let jwt = Jwt::new(&[7u8; 32]).unwrap();
        let t = Uuid::new_v4();
        let tok = jwt
            .issue(
                "ana",
                Role::TenantAdmin,
                Some(t),
                std::time::Duration::from_secs(60),
            )
            .unwrap();
        let c = jwt.check(&tok).unwrap();
        assert_eq!(
            (c.role, c.tenant, c.sub.as_str()),
            (Role::TenantAdmin, Some(t), "ana")
        );
        assert!(matches!(
            jwt.issue(
                "ana",
                Role::TenantAdmin,
                None,
                std::time::Duration::from_secs(60)
            ),
            Err(IdentityError::Invalid(_))
        ));
        assert!(Jwt::new(b"short").is_err());
        let other = Jwt::new(&[8u8; 32]).unwrap();
        let e = other.check(&tok).unwrap_err();
        assert_eq!(e.error_code(), ErrorCode::Authentication);
    }

    #[test]
    fn roles_parse_from_their_names() {
        for r in [Role::PlatformAdmin, Role::Finance, Role::TenantAdmin] {
            assert_eq!(Role::parse(r.as_str()), Some(r));
        }
        assert_eq!(Role::parse("root"), None);
    }
}
