import { useState } from "preact/hooks";
import { api, qs, type Me } from "../api";
import { ErrorBanner, Field, Loaded, Table, useAction, useAsync } from "../components/ui";
import { count, formatTime } from "../format";
import { validateTenantName } from "../forms";
import { navigate } from "../router";
import type { Tenant } from "../types";

export function TenantsPage({ me }: { me: Me }) {
  const [showDeleted, setShowDeleted] = useState(false);
  const list = useAsync(
    () => api<{ data: Tenant[] }>("GET", `/v1/admin/tenants${qs({ include_deleted: showDeleted })}`),
    [showDeleted],
  );
  return (
    <section>
      <h1>Tenants</h1>
      {me.role === "platform_admin" && <CreateTenant onCreated={(t) => navigate(`/tenants/${t.id}/dashboard`)} />}
      <label>
        <input type="checkbox" role="switch" checked={showDeleted} onChange={(e) => setShowDeleted(e.currentTarget.checked)} />
        Show deleted tenants
      </label>
      <Loaded state={list} what="tenants">
        <Table caption={count(list.data?.data.length ?? 0, "tenant")} columns={["Name", "State", "Active keys", "Created"]}>
          <tbody>
            {list.data?.data.map((t) => (
              <tr key={t.id}>
                <td>
                  <a href={`#/tenants/${t.id}/dashboard`}>{t.name}</a>
                </td>
                <td class={`state-${t.state}`}>{t.state}</td>
                <td>{t.active_keys}</td>
                <td>{formatTime(t.created_at)}</td>
              </tr>
            ))}
          </tbody>
        </Table>
      </Loaded>
    </section>
  );
}

function CreateTenant({ onCreated }: { onCreated: (t: Tenant) => void }) {
  const [name, setName] = useState("");
  const [fieldError, setFieldError] = useState<string | undefined>();
  const { busy, error, run } = useAction();
  return (
    <form
      class="row"
      aria-label="Create a tenant"
      onSubmit={async (e) => {
        e.preventDefault();
        const invalid = validateTenantName(name);
        setFieldError(invalid ?? undefined);
        if (invalid) return;
        await run(async () => {
          const t = await api<Tenant>("POST", "/v1/admin/tenants", { name: name.trim() });
          onCreated(t);
        });
      }}
    >
      <Field id="tenant-name" label="New tenant's name" value={name} error={fieldError} onInput={(e) => setName(e.currentTarget.value)} />
      <button type="submit" aria-busy={busy} disabled={busy}>
        Create tenant
      </button>
      <ErrorBanner error={error} />
    </form>
  );
}
