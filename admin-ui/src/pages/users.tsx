import { useState } from "preact/hooks";
import { api, type Me } from "../api";
import { Confirm, ErrorBanner, Field, Loading, Notice, PasswordField, SecretDialog, Table, useAction, useAsync } from "../components/ui";
import { formatTime } from "../format";
import { validateUser } from "../forms";
import type { Tenant, User } from "../types";

function CreateUser(props: { tenants: Tenant[]; fixedTenant?: Tenant; onCreated: (u: User) => void }) {
  const [u, setU] = useState({
    username: "",
    password: "",
    role: props.fixedTenant ? "tenant_admin" : "finance",
    tenant: props.fixedTenant?.id ?? "",
  });
  const [errors, setErrors] = useState<Record<string, string>>({});
  const { busy, error, run } = useAction();
  return (
    <form
      aria-label="Create a user"
      onSubmit={async (e) => {
        e.preventDefault();
        const errs = validateUser(u);
        setErrors(errs);
        if (Object.keys(errs).length) return;
        await run(async () => {
          const created = await api<User>("POST", "/v1/admin/users", {
            username: u.username.trim(),
            password: u.password,
            role: u.role,
            tenant: u.role === "tenant_admin" ? u.tenant : null,
          });
          setU({ ...u, username: "", password: "" });
          props.onCreated(created);
        });
      }}
    >
      <div class="row">
        <Field id="new-username" label="Username" autoComplete="off" value={u.username} error={errors.username} onInput={(e) => setU({ ...u, username: e.currentTarget.value })} />
        <PasswordField id="new-password" label="Password (12+ characters)" kind="new" value={u.password}
          error={errors.password} onValue={(password) => setU({ ...u, password })} />
        {!props.fixedTenant && (
          <>
            <label for="new-role">
              Role
              <select id="new-role" value={u.role} onChange={(e) => setU({ ...u, role: e.currentTarget.value })}>
                <option value="platform_admin">Platform admin</option>
                <option value="tenant_admin">Tenant admin</option>
                <option value="finance">Finance</option>
              </select>
            </label>
            {u.role === "tenant_admin" && (
              <label for="new-tenant">
                Tenant
                <select id="new-tenant" value={u.tenant} aria-invalid={errors.tenant ? "true" : undefined} onChange={(e) => setU({ ...u, tenant: e.currentTarget.value })}>
                  <option value="">Choose…</option>
                  {props.tenants.map((t) => (
                    <option key={t.id} value={t.id}>
                      {t.name}
                    </option>
                  ))}
                </select>
                {errors.tenant && <small class="field-error">{errors.tenant}</small>}
              </label>
            )}
          </>
        )}
        <button type="submit" aria-busy={busy} disabled={busy}>
          Create user
        </button>
      </div>
      <ErrorBanner error={error} />
    </form>
  );
}

interface ResetSecret {
  username: string;
  reset_secret: string;
  expires_at: string;
}

function UserTable(props: { users: User[]; tenants: Tenant[]; onChange: () => void }) {
  const [disabling, setDisabling] = useState<User | null>(null);
  const [resetting, setResetting] = useState<User | null>(null);
  const [secret, setSecret] = useState<ResetSecret | null>(null);
  const name = (id: string | null) => props.tenants.find((t) => t.id === id)?.name ?? id ?? "–";
  return (
    <>
      <Table caption="Users" columns={["Username", "Role", "Tenant", "Last login", "State", "Actions"]} rows={props.users} row={(u) => {
        const locked = u.locked_until && new Date(u.locked_until) > new Date();
        return (
          <tr key={u.id}>
            <td>{u.username}</td>
            <td>{u.role.replace("_", " ")}</td>
            <td>{u.tenant ? name(u.tenant) : "–"}</td>
            <td>{formatTime(u.last_login_at)}</td>
            <td>{u.disabled_at ? "disabled" : locked ? `locked until ${formatTime(u.locked_until)}` : "active"}</td>
            <td>
              {!u.disabled_at && (
                <div class="actions">
                  {(locked || u.failed_logins > 0) && (
                    <button type="button" class="secondary" onClick={() => api("POST", `/v1/admin/users/${u.id}/unlock`).then(props.onChange)}>
                      Unlock
                    </button>
                  )}
                  <button type="button" class="secondary" onClick={() => setResetting(u)} aria-label={`Reset the password of ${u.username}`}>
                    Reset password
                  </button>
                  <button type="button" class="danger" onClick={() => setDisabling(u)} aria-label={`Disable ${u.username}`}>
                    Disable
                  </button>
                </div>
              )}
            </td>
          </tr>
        );
        }}
      />
      <Confirm
        open={resetting !== null}
        title={`Reset the password of ${resetting?.username ?? ""}?`}
        body={
          <p>
            You get a one-time secret to give them. With it they set a new password on the login page (within a day, once); then all
            their sessions end. Their current password keeps working until then.
          </p>
        }
        action="Make a reset secret"
        onClose={() => setResetting(null)}
        onConfirm={async () => {
          setSecret(await api<ResetSecret>("POST", `/v1/admin/users/${resetting!.id}/password-reset`));
          props.onChange();
        }}
      />
      <SecretDialog
        title={`Reset secret for ${secret?.username ?? ""}`}
        secret={secret?.reset_secret ?? null}
        note={`Give this to ${secret?.username ?? "them"} by a channel you trust. It works once, until ${formatTime(secret?.expires_at ?? null)}, and is shown this once.`}
        onClose={() => setSecret(null)}
      />
      <Confirm
        open={disabling !== null}
        title={`Disable ${disabling?.username ?? ""}?`}
        body={<p>They are logged out at once and cannot log in again.</p>}
        action="Disable"
        danger
        onClose={() => setDisabling(null)}
        onConfirm={async () => {
          await api("DELETE", `/v1/admin/users/${disabling!.id}`);
          props.onChange();
        }}
      />
    </>
  );
}

export function UsersPage({ me }: { me: Me }) {
  const data = useAsync(async () => {
    const [users, tenants] = await Promise.all([
      api<{ data: User[] }>("GET", "/v1/admin/users"),
      api<{ data: Tenant[] }>("GET", "/v1/admin/tenants"),
    ]);
    return { users: users.data, tenants: tenants.data };
  }, []);
  const [notice, setNotice] = useState<string | null>(null);
  if (me.role !== "platform_admin") return <p>Only platform admins manage users.</p>;
  return (
    <section>
      <h1>Users</h1>
      <ErrorBanner error={data.error} />
      <Notice text={notice} />
      {data.data ? (
        <>
          <CreateUser
            tenants={data.data.tenants}
            onCreated={(u) => {
              setNotice(`User ${u.username} created.`);
              data.reload();
            }}
          />
          <UserTable users={data.data.users} tenants={data.data.tenants} onChange={data.reload} />
        </>
      ) : (
        <Loading what="users" />
      )}
    </section>
  );
}

/** A tenant's administrators, on the tenant's page (platform admins). */
export function TenantAdmins({ tenant }: { tenant: Tenant }) {
  const users = useAsync(() => api<{ data: User[] }>("GET", "/v1/admin/users"), []);
  const [notice, setNotice] = useState<string | null>(null);
  const mine = users.data?.data.filter((u) => u.tenant === tenant.id) ?? [];
  return (
    <section aria-labelledby="admins-title">
      <h2 id="admins-title">Tenant admins</h2>
      <ErrorBanner error={users.error} />
      <Notice text={notice} />
      {tenant.state !== "deleted" && (
        <CreateUser
          tenants={[tenant]}
          fixedTenant={tenant}
          onCreated={(u) => {
            setNotice(`Tenant admin ${u.username} created.`);
            users.reload();
          }}
        />
      )}
      <UserTable users={mine} tenants={[tenant]} onChange={users.reload} />
    </section>
  );
}
