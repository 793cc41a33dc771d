import { useState } from "preact/hooks";
import { api, type Me } from "../api";
import { Confirm, ErrorBanner, Loading, useAsync } from "../components/ui";
import { formatTime } from "../format";
import type { Tenant } from "../types";
import { DashboardTab } from "./dashboard";
import { KeysTab } from "./keys";
import { PolicyTab } from "./policy";
import { CacheTab } from "./cache";
import { AuditPage } from "./audit";
import { TenantAdmins } from "./users";
import { WorkspacesTab } from "./workspaces";
import { AlertsTab } from "./alerts";

const TABS: [string, string, (m: Me) => boolean][] = [
  ["dashboard", "Dashboard", () => true],
  ["workspaces", "Workspaces", () => true],
  ["keys", "Keys", (m) => m.role !== "finance"],
  ["policy", "Quotas & policy", () => true],
  ["cache", "Cache", () => true],
  ["alerts", "Alerts", () => true],
  ["audit", "Audit log", (m) => m.role !== "finance"],
  ["admins", "Admins", (m) => m.role === "platform_admin"],
];

export function TenantPage({ me, id, tab }: { me: Me; id: string; tab: string }) {
  const t = useAsync(() => api<Tenant>("GET", `/v1/admin/tenants/${id}`), [id]);
  const [confirm, setConfirm] = useState<"suspend" | "resume" | "delete" | null>(null);
  const tabs = TABS.filter(([, , allowed]) => allowed(me));
  if (t.error) return <ErrorBanner error={t.error} />;
  if (!t.data) return <Loading what="the tenant" />;
  const tenant = t.data;
  return (
    <section>
      <hgroup>
        <h1>{tenant.name}</h1>
        <p>
          <span class={`state-${tenant.state}`}>{tenant.state}</span> · created {formatTime(tenant.created_at)} ·{" "}
          <code>{tenant.id}</code>
        </p>
      </hgroup>
      {me.role === "platform_admin" && tenant.state !== "deleted" && (
        <div class="actions">
          {tenant.state === "active" ? (
            <button type="button" class="secondary" onClick={() => setConfirm("suspend")}>
              Suspend
            </button>
          ) : (
            <button type="button" class="secondary" onClick={() => setConfirm("resume")}>
              Resume
            </button>
          )}
          <button type="button" class="danger" onClick={() => setConfirm("delete")}>
            Delete tenant
          </button>
        </div>
      )}
      <Confirm
        open={confirm !== null}
        title={confirm === "delete" ? `Delete ${tenant.name}?` : confirm === "suspend" ? `Suspend ${tenant.name}?` : `Resume ${tenant.name}?`}
        body={
          confirm === "delete" ? (
            <p>Its keys are revoked and its cache purged on every node. Its usage and invoices are kept. This cannot be undone.</p>
          ) : confirm === "suspend" ? (
            <p>Its API keys are refused (403) within seconds, until it is resumed.</p>
          ) : (
            <p>Its API keys work again within seconds.</p>
          )
        }
        action={confirm === "delete" ? "Delete" : confirm === "suspend" ? "Suspend" : "Resume"}
        danger={confirm !== "resume"}
        onClose={() => setConfirm(null)}
        onConfirm={async () => {
          const updated =
            confirm === "delete"
              ? await api<Tenant>("DELETE", `/v1/admin/tenants/${id}`)
              : await api<Tenant>("POST", `/v1/admin/tenants/${id}/${confirm}`);
          t.setData(updated);
        }}
      />
      <nav aria-label="Tenant sections">
        <ul class="tabs">
          {tabs.map(([key, label]) => (
            <li key={key}>
              <a href={`#/tenants/${id}/${key}`} aria-current={tab === key ? "page" : undefined}>
                {label}
              </a>
            </li>
          ))}
        </ul>
      </nav>
      {tab === "dashboard" && <DashboardTab tenant={tenant} />}
      {tab === "workspaces" && <WorkspacesTab tenant={tenant} canEdit={me.role !== "finance"} />}
      {tab === "keys" && <KeysTab tenant={tenant} />}
      {tab === "policy" && <PolicyTab me={me} tenant={tenant} />}
      {tab === "cache" && <CacheTab tenant={tenant} canEdit={me.role !== "finance"} />}
      {tab === "alerts" && <AlertsTab tenant={tenant} canEdit={me.role !== "finance"} />}
      {tab === "audit" && <AuditPage me={me} tenant={tenant} />}
      {tab === "admins" && <TenantAdmins tenant={tenant} />}
      {!tabs.some(([key]) => key === tab) && <p>No such section.</p>}
    </section>
  );
}
