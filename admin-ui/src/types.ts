// Shapes of the admin and finance APIs' answers (see openapi/openapi.json).

export interface Tenant {
  id: string;
  name: string;
  state: "active" | "suspended" | "deleted";
  created_at: string;
  suspended_at: string | null;
  deleted_at: string | null;
  active_keys: number;
}

export interface Key {
  id: string;
  tenant_id: string;
  workspace_id: string;
  name: string;
  prefix: string;
  state: "active" | "rotating" | "expired" | "revoked";
  created_at: string;
  last_used_at: string | null;
  expires_at: string | null;
  revoked_at: string | null;
  rotated_to: string | null;
  /** The key's own rate limits (null: the tenant's per-key default); never a budget. */
  limits: Limits;
  /** The key's own tags, on top of its workspace's. */
  tags: Record<string, string>;
}

export interface CreatedKey extends Key {
  secret: string | null;
}

export interface Rotation {
  old_key: Key;
  new_key: Key;
  secret: string | null;
  grace_until: string;
  replayed: boolean;
}

/** Requests, tokens by class and cache objects held, as every usage report counts them. */
export interface Tokens {
  requests: number;
  input_tokens: number;
  cache_write_5m_tokens: number;
  cache_write_1h_tokens: number;
  cache_read_tokens: number;
  output_tokens: number;
  /** Cache objects held: tokens × seconds (their cost is in `cost_minor`). */
  cache_storage_token_seconds: number;
}

export interface UsagePoint extends Tokens {
  bucket_start?: string;
  model?: string;
  api_key?: string;
  workspace?: string;
  /** The tag's value in a split by tag (absent: keys without it). */
  tag?: string;
  hit_ratio: number;
  cost_minor: number;
  cost_without_cache_minor: number;
  saved_minor: number;
  /** The exact amounts behind the three above (`"0.0000519"`). */
  cost: string;
  cost_without_cache: string;
  saved: string;
  unpriced_tokens: number;
}

export interface UsageView {
  tenant: string;
  from: string;
  to: string;
  granularity: "hour" | "day";
  group_by: "none" | "model" | "api_key" | "workspace" | "tag";
  currency: string;
  totals: UsagePoint;
  series: UsagePoint[];
  key_names: Record<string, string>;
  workspace_names: Record<string, string>;
  /** The tag names the tenant's keys and workspaces carry. */
  tag_names: string[];
  /** Cache writes the fabric did not hold in the range, by reason (the whole tenant's). */
  cache_writes_not_held: NotHeld[];
}

export interface NotHeld {
  reason: string;
  breakpoints: number;
  tokens: number;
}

export interface BudgetView {
  currency: string;
  limit_minor: number | null;
  alert_percent: number;
  spent_minor: number;
  month_start: string;
  resets_at: string;
  state: "none" | "ok" | "alert" | "exhausted";
  refusals: { limit: string; count: number }[];
}

export interface CacheView {
  quota_bytes: number | null;
  reserved_bytes: number | null;
  total_bytes: number;
  tiers: { tier: string; blocks: number; bytes: number }[];
  evictions: Record<string, number>;
  top_prefixes: {
    hash: string;
    tokens: number;
    bytes: number;
    reads: number;
    ttl_left_ms: number;
    ttl_secs: number;
    paid: boolean;
  }[];
  nodes: number;
  unreachable_nodes: number;
}

/** A cache object (`POST /v1/caches`) as the admin API lists it. */
export interface CacheObject {
  id: string;
  model: string;
  display_name: string | null;
  input_tokens: number;
  workspace_id: string;
  workspace_name: string;
  created_at: string;
  expires_at: string;
}

export interface AuditRow {
  id: number;
  at: string;
  actor: string;
  actor_role: string | null;
  tenant_id: string | null;
  action: string;
  target: string | null;
  before: unknown;
  after: unknown;
  request_id: string | null;
  tenant_name: string | null;
  /** The object by name (a tenant, a console user, an API key), when it is one of those. */
  target_name: string | null;
}

export interface User {
  id: string;
  username: string;
  role: "platform_admin" | "tenant_admin" | "finance";
  tenant: string | null;
  created_at: string;
  disabled_at: string | null;
  locked_until: string | null;
  last_login_at: string | null;
  failed_logins: number;
}

export interface InvoiceSummary {
  id: string;
  tenant_id: string;
  period_start: string;
  currency: string;
  status: "draft" | "finalized";
  total_minor: number;
}

export interface Invoice extends InvoiceSummary {
  lines: {
    kind: string;
    model: string | null;
    token_class: string | null;
    quantity: number;
    /** The line's exact amount in nano-units (decimal text), before any rounding. */
    exact_nanos: string;
    /** The line's exact amount in the currency, as every document writes it (`0.0000519`). */
    amount: string;
    /** The line's share of `total_minor` (they add up to it). */
    amount_minor: number;
    description: string;
  }[];
  /** What the total's one rounding added to the lines' exact sum, written as a line. */
  rounding: { exact_nanos: string; amount: string; description: string };
  /** The total in the currency (`0.12`). */
  total: string;
  /** When the lines were rated from the ledger. */
  rated_at: string;
  finalized_at: string | null;
  /** Models whose usage had no price in force: listed at zero, not billed. */
  unpriced: string[];
}

/**
 * Rate and spend limits at one level (a tenant's own, a workspace's; a key's are the policy's
 * `key_*` fields), as the API writes them: null is no limit at that level.
 */
export interface Limits {
  requests_per_minute: number | null;
  input_tokens_per_minute: number | null;
  output_tokens_per_minute: number | null;
  monthly_budget_minor: number | null;
}

export interface Workspace {
  id: string;
  tenant_id: string;
  name: string;
  is_default: boolean;
  created_at: string;
  archived_at: string | null;
  limits: Limits;
  active_keys: number;
  tags: Record<string, string>;
}

export interface WebhookEndpoint {
  id: string;
  tenant_id: string;
  url: string;
  created_at: string;
  disabled_at: string | null;
  secret_prefix: string;
}

export interface WebhookDelivery {
  id: number;
  endpoint_id: string;
  url: string;
  event_id: string;
  event_type: string;
  payload: { data?: { threshold_percent?: number; spent?: string; limit?: string; currency?: string; workspace_id?: string | null } };
  created_at: string;
  state: "pending" | "delivered" | "failed";
  attempts: number;
  next_attempt_at: string | null;
  last_status: number | null;
  last_error: string | null;
  delivered_at: string | null;
}
